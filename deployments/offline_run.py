"""`deepseek-ocr batch INPUT... --out DIR` (also `python -m deployments.offline_run`): a corpus
OCR'd offline on Ray Data (deployments/offline.py), its rows written as the pipeline streams.

INPUT: files, folders (searched recursively), globs; images and PDFs; local, or on object
storage by URI (`s3://bucket/prefix`, any filesystem pyarrow opens), all on one filesystem.
`--out DIR` (local or a URI) gets one Parquet (or JSONL) file per block, under a folder per run.
A rerun into the same `--out` skips every page already written with the same options (its
file's content hash, page and options' hash): a run killed midway is finished by running it
again, no page twice. A file of an interrupted run that cannot be read whole is removed first
(its pages are done again): one run at a time into a folder (a file another run is still
writing would look interrupted).
"""
from __future__ import annotations

import argparse
import fnmatch
import hashlib
import json
import os
import sys
import time

from corpus.inputs import EXTENSIONS

KEY = ("content_sha256", "page", "options_sha256")  # a page done, with the options it was done with
FORMATS = {"parquet": ".parquet", "jsonl": ".json"}


def options_sha256(model: str | None, options: dict) -> str:
    """The options a page was read with, as a hash: the same options rerun skip it."""
    return hashlib.sha256(json.dumps({"model": model, **options}, sort_keys=True).encode()).hexdigest()[:16]


def filesystem_of(location: str):
    """(pyarrow filesystem, path in it) of a local path or a URI."""
    from pyarrow import fs
    if "://" in location:
        return fs.FileSystem.from_uri(location)
    return fs.LocalFileSystem(), os.path.abspath(location)


def find_files(arguments: list[str]) -> tuple[object, list[str]]:
    """The filesystem the arguments are on and every supported file they name, sorted, once."""
    from pyarrow import fs as pafs
    found, systems = set(), set()
    filesystem = None
    for argument in arguments:
        filesystem, path = filesystem_of(argument)
        systems.add(filesystem.type_name)
        if any(ch in path for ch in "*?["):  # a glob: matched against its folder's files
            folder = path[:min(path.index(ch) for ch in "*?[" if ch in path)].rsplit("/", 1)[0]
            infos = filesystem.get_file_info(pafs.FileSelector(folder, recursive=True, allow_not_found=True))
            found |= {i.path for i in infos if i.type == pafs.FileType.File and matches(i.path, path)}
            continue
        info = filesystem.get_file_info(path)
        if info.type == pafs.FileType.NotFound:
            raise SystemExit(f"deepseek-ocr batch: {argument}: no such file or folder")
        if info.type == pafs.FileType.Directory:
            infos = filesystem.get_file_info(pafs.FileSelector(path, recursive=True))
            found |= {i.path for i in infos if i.type == pafs.FileType.File and not i.base_name.startswith(".")}
        else:
            found.add(path)
    if len(systems) > 1:
        raise SystemExit(f"deepseek-ocr batch: inputs on one filesystem at a time, got {sorted(systems)}")
    files = sorted(p for p in found if os.path.splitext(p)[1].lower() in EXTENSIONS)
    if not files:
        raise SystemExit(f"deepseek-ocr batch: no inputs found in {' '.join(arguments)} "
                         f"(supported: {' '.join(sorted(EXTENSIONS))})")
    return filesystem, files


def matches(path: str, pattern: str) -> bool:
    """A glob's match as a shell's: `*` stays within a folder; `**` crosses folders."""
    if "**" in pattern:
        return fnmatch.fnmatch(path, pattern.replace("**", "*"))
    return path.count("/") == pattern.count("/") and fnmatch.fnmatch(path, pattern)


def done_pages(out: str) -> set[tuple]:
    """The keys of the pages written under `out` by earlier runs. A file that cannot be read
    whole (its run was killed while writing it) is removed: its pages are done again."""
    from pyarrow import fs as pafs
    from pyarrow import json as pajson
    from pyarrow import parquet
    filesystem, root = filesystem_of(out)
    infos = filesystem.get_file_info(pafs.FileSelector(root, recursive=True, allow_not_found=True))
    done = set()
    for info in infos:
        if info.type != pafs.FileType.File or not info.path.endswith(tuple(FORMATS.values())):
            continue
        try:
            if info.path.endswith(".parquet"):
                table = parquet.read_table(info.path, columns=list(KEY), filesystem=filesystem)
            else:
                with filesystem.open_input_stream(info.path) as f:
                    table = pajson.read_json(f).select(list(KEY))
        except Exception:  # noqa: BLE001 - any unreadable file: an interrupted write
            filesystem.delete_file(info.path)
            continue
        done |= set(zip(*(table.column(key).to_pylist() for key in KEY)))
    return done


def run(arguments: list[str], out: str, file_format: str = "parquet", checkpoint: str | None = None,
        stages: dict | None = None, **options) -> dict:
    """OCR every file the arguments name into `out`, skipping pages done before; returns the
    run's summary (pages, tokens, pages/s, errors, where it wrote). `stages`: `Stages`' fields
    asked for (the rest: `default_layout`'s for this cluster)."""
    import ray

    from .offline import default_layout, ocr_dataset
    layout, config = default_layout(checkpoint, ray.cluster_resources().get("GPU", 0), **(stages or {}))
    filesystem, files = find_files(arguments)
    out_fs, out_root = filesystem_of(out)
    run_dir = f"{out_root.rstrip('/')}/run-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    options_hash = options_sha256(checkpoint, options)
    done = {key[:2] for key in done_pages(out) if key[2] == options_hash}
    start = time.perf_counter()
    rows = ocr_dataset(ray.data.read_binary_files(files, include_paths=True, filesystem=filesystem),
                       config=config, stages=layout, skip=done, **options)
    rows = rows.map_batches(_with_options_hash, fn_kwargs={"options_hash": options_hash}, batch_format="pyarrow")
    writer = rows.write_parquet if file_format == "parquet" else rows.write_json
    writer(run_dir, filesystem=out_fs)
    seconds = time.perf_counter() - start
    pages, tokens, errors = _written(out_fs, run_dir, file_format)
    return {"files": len(files), "pages": pages, "pages_done_before": len(done), "completion_tokens": tokens,
            "errors": errors, "seconds": seconds, "pages_per_s": pages / seconds if seconds else 0.0,
            "out": run_dir}


def _written(filesystem, run_dir: str, file_format: str) -> tuple[int, int, int]:
    """(pages, completion tokens, error rows) of what this run wrote (read back with pyarrow:
    no further Ray Data job)."""
    from pyarrow import dataset as pads
    from pyarrow import fs as pafs
    if filesystem.get_file_info(run_dir).type != pafs.FileType.Directory:
        return 0, 0, 0  # nothing written: every page was done before
    table = pads.dataset(run_dir, filesystem=filesystem, format="parquet" if file_format == "parquet" else "json")
    table = table.to_table(columns=["completion_tokens", "error"])
    tokens = sum(t for t in table.column("completion_tokens").to_pylist() if t)
    return table.num_rows, tokens, table.num_rows - table.column("error").null_count


def _with_options_hash(table, options_hash: str):
    import pyarrow as pa
    return table.append_column("options_sha256", pa.array([options_hash] * table.num_rows, pa.string()))


def resources(text: str) -> dict:
    """A JSON object of resource names to amounts (argparse's type: a bad one exits 2 naming it)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, dict) or not all(isinstance(v, (int, float)) and v > 0 for v in value.values()):
        raise argparse.ArgumentTypeError(f"not a JSON object of positive amounts: {text!r}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="deepseek-ocr batch", description=__doc__.split("\n\n")[0])
    parser.add_argument("inputs", nargs="+", metavar="INPUT")
    parser.add_argument("--out", required=True, help="folder (or URI) the rows are written under")
    parser.add_argument("--format", choices=list(FORMATS), default="parquet")
    parser.add_argument("--model", help="checkpoint folder (default: the tiny random model)")
    parser.add_argument("--address", help="the Ray cluster (default: RAY_ADDRESS, else a local one)")
    parser.add_argument("--mode", default="gundam")
    parser.add_argument("--max-crops", type=int)
    parser.add_argument("--prompt")
    parser.add_argument("--preset", dest="prompt_preset")
    parser.add_argument("--output-format", choices=("text", "markdown", "blocks"), default="text",
                        help="blocks: also `markdown` and `blocks` columns (a JSON list, boxes in pixels)")
    parser.add_argument("--max-tokens", type=int)
    parser.add_argument("--dpi", type=int)
    parser.add_argument("--pages-per-request", type=int,
                        help="a PDF's pages read that many at a time as one request (--mode base; Unlimited-OCR)")
    layout = parser.add_argument_group("layout", "the pools' actors and where they run (default: one "
                                       "actor each; with GPUs, one card shared: 0.25 per encoder path, 0.5 decoder)")
    layout.add_argument("--encoders", type=int, help="actors per encoder path")
    layout.add_argument("--decoders", type=int, help="decoder actors")
    layout.add_argument("--encoder-gpus", type=float, help="GPU share of an encoder actor")
    layout.add_argument("--decoder-gpus", type=float, help="GPU share of a decoder actor")
    layout.add_argument("--encoder-resources", type=resources, metavar="JSON",
                        help='custom resources an encoder actor asks for (the nodes to run on: {"encoder_gpu": 1})')
    layout.add_argument("--decoder-resources", type=resources, metavar="JSON",
                        help='custom resources a decoder actor asks for ({"decoder_gpu": 1})')
    args = parser.parse_args(argv)
    from .protocol import BadRequest, OcrOptions, validate
    options = {key: value for key, value in (
        ("mode", args.mode), ("max_crops", args.max_crops), ("prompt", args.prompt),
        ("prompt_preset", args.prompt_preset), ("output_format", args.output_format),
        ("max_tokens", args.max_tokens), ("dpi", args.dpi), ("pages_per_request", args.pages_per_request))
        if value is not None}
    try:
        validate(OcrOptions, options, strict=False)  # before any cluster starts
    except BadRequest as e:
        print(f"deepseek-ocr batch: {e}", file=sys.stderr)
        return 2
    import ray
    try:
        import ray.data  # noqa: F401
    except ImportError:
        print("deepseek-ocr batch: needs Ray Data: pip install -e '.[offline]'", file=sys.stderr)
        return 2
    ray.init(address=args.address, log_to_driver=False)
    try:
        stages = {name: getattr(args, name) for name in ("encoders", "decoders", "encoder_gpus", "decoder_gpus",
                                                         "encoder_resources", "decoder_resources")
                  if getattr(args, name) is not None}
        summary = run(args.inputs, args.out, args.format, args.model, stages, **options)
    except BadRequest as e:  # what only the model tells (its modes, its context)
        print(f"deepseek-ocr batch: {e}", file=sys.stderr)
        return 2
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
