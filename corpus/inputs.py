"""Which files a run OCRs, and where each one's outputs go.

An argument is a file, a folder (searched recursively for the supported extensions, hidden names
skipped) or `@list`,
a text file naming one path per line (blank lines and `#` comments skipped; relative paths are
relative to the working directory, as with `tar -T`). A folder's files keep their paths relative
to it under the output folder; a single file gets its basename. Two inputs may not share an
output name: where only the extension tells them apart (`scan.pdf`, `scan.png`) both keep it in
their names (`scan.pdf.md`, `scan.png.md`); any other clash is a usage error.
"""
from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass

from .errors import UsageError

DOCUMENT_EXTENSIONS = {".pdf"}
IMAGE_EXTENSIONS = {".png", ".jpg", ".jpeg", ".webp", ".tif", ".tiff", ".bmp", ".gif"}
EXTENSIONS = DOCUMENT_EXTENSIONS | IMAGE_EXTENSIONS


@dataclass(frozen=True)
class Input:
    """One file to OCR."""

    path: str  # as found: the argument, or the folder argument joined with the relative path
    output: str  # output name without suffix, relative to the output folder, "/"-separated

    @property
    def kind(self) -> str:
        """`document` (sent as a PDF, page by page on the server) or `image`."""
        return "document" if _extension(self.path) in DOCUMENT_EXTENSIONS else "image"

    @property
    def name(self) -> str:
        """The output's base name: it prefixes the document's figure crops."""
        return self.output.rsplit("/", 1)[-1]


def find_inputs(arguments: list[str], out_dir: str) -> list[Input]:
    """Every input the arguments name, each once, with its output name; never empty."""
    found: list[tuple[str, str]] = []  # (path, output name with the extension)
    for argument in arguments:
        found += _expand(argument, out_dir)
    unique, seen = [], set()
    for path, relative in found:  # the same file named twice (a folder and a list) runs once
        real = os.path.realpath(path)
        if real not in seen:
            seen.add(real)
            unique.append((path, relative))
    if not unique:
        raise UsageError(f"no inputs found in {' '.join(arguments)} (supported: "
                         f"{' '.join(sorted(EXTENSIONS))})")
    return _name_outputs(unique)


def _expand(argument: str, out_dir: str) -> list[tuple[str, str]]:
    if argument.startswith("@"):
        found = []
        for path in read_list(argument[1:]):
            found += _expand(path, out_dir)
        return found
    if os.path.isdir(argument):
        return _walk(argument, out_dir)
    if not os.path.isfile(argument):
        raise UsageError(f"no such file or folder: {argument}")
    if _extension(argument) not in EXTENSIONS:
        raise UsageError(f"{argument}: not a supported input (supported: {' '.join(sorted(EXTENSIONS))})")
    return [(argument, os.path.basename(argument))]


def read_list(list_path: str) -> list[str]:
    """The paths a list file names."""
    try:
        with open(list_path, encoding="utf-8") as f:
            lines = [line.strip() for line in f]
    except OSError as e:
        raise UsageError(f"cannot read the list file {list_path}: {e.strerror}") from None
    return [line for line in lines if line and not line.startswith("#")]


def _walk(folder: str, out_dir: str) -> list[tuple[str, str]]:
    """Supported files under `folder`, sorted. Skipped: the output folder (or a rerun would OCR
    the last run's figure crops) and hidden names (`.git/`, macOS's `._scan.pdf` metadata files,
    which are not PDFs)."""
    skip = os.path.realpath(out_dir)
    found = []
    for directory, subdirs, files in os.walk(folder):
        subdirs[:] = sorted(d for d in subdirs if not d.startswith(".")
                            and os.path.realpath(os.path.join(directory, d)) != skip)
        for name in sorted(files):
            if not name.startswith(".") and _extension(name) in EXTENSIONS:
                path = os.path.join(directory, name)
                found.append((path, os.path.relpath(path, folder).replace(os.sep, "/")))
    return found


def _name_outputs(found: list[tuple[str, str]]) -> list[Input]:
    # Case-folded: on a case-insensitive file system `A.md` and `a.md` are one file.
    by_stem = defaultdict(list)
    for path, relative in found:
        by_stem[_strip_extension(relative).casefold()].append((path, relative))
    named = {}
    for group in by_stem.values():
        for path, relative in group:
            named[path] = relative if len(group) > 1 else _strip_extension(relative)
    clashes = defaultdict(list)
    for path, output in named.items():
        clashes[output.casefold()].append(path)
    clashing = [paths for paths in clashes.values() if len(paths) > 1]
    if clashing:
        listed = "; ".join(" and ".join(paths) for paths in clashing)
        raise UsageError(f"inputs would write the same outputs: {listed} (give their folder "
                         f"instead, so they keep their relative paths)")
    return [Input(path, named[path]) for path, _ in found]


def _extension(path: str) -> str:
    return os.path.splitext(path)[1].lower()


def _strip_extension(relative: str) -> str:
    return os.path.splitext(relative)[0]
