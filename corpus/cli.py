"""`deepseek-ocr run INPUTS... --out DIR`: OCR files and folders through a running app.
`deepseek-ocr serve CONFIG_OR_IMPORT_PATH [ARGS...]`: start the app (`serve run` in the app's
start-up environment: `python -m deployments`, which this command hands over to).
`deepseek-ocr batch INPUT... --out DIR [OPTIONS]`: OCR a corpus offline on a Ray cluster, no
server (Ray Data: `python -m deployments.offline_run`, which this command hands over to).

Exit codes: 0 every document done; 1 some failed (listed at the end; a rerun retries them);
2 a usage error: bad arguments, no inputs, the server unreachable at the start, a refused key.
"""
from __future__ import annotations

import argparse
import os
import sys
import threading

from .client import Client
from .errors import UsageError
from .inputs import Input, find_inputs
from .manifest import Manifest, StateStore
from .outputs import FORMATS
from .progress import Progress
from .run import RunOptions, Worker, parse_page_range, plan, run_jobs

DEFAULT_SERVER = "http://127.0.0.1:8000"
DEFAULT_TIMEOUT_S = 1800.0  # one request carries a whole document
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="deepseek-ocr", description="OCR documents through a running DeepSeek-OCR app.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    run = commands.add_parser(
        "run", help="OCR files, folders and @lists into an output folder (resumable)",
        description="OCR files, folders (recursive) and @list files (one path a line) into DIR, "
                    "mirroring the input tree. Reruns skip what DIR/manifest.jsonl records as "
                    "done and redo only the failed pages of partial documents.",
        epilog="exit codes: 0 all done, 1 some documents failed, 2 usage error "
               "(bad arguments, no inputs, server unreachable, API key refused)")
    run.add_argument("inputs", nargs="+", metavar="INPUT",
                     help="a PDF or image, a folder, or @list.txt")
    run.add_argument("--out", required=True, metavar="DIR", help="output folder")
    run.add_argument("--server", type=_server_url, metavar="URL",
                     default=os.environ.get("DEEPSEEK_OCR_SERVER", DEFAULT_SERVER), help="the app's URL (env DEEPSEEK_OCR_SERVER; default %(default)s)")
    run.add_argument("--api-key", default=os.environ.get("DEEPSEEK_OCR_API_KEY"), metavar="KEY",
                     help="sent as 'Authorization: Bearer KEY' (env DEEPSEEK_OCR_API_KEY)")
    run.add_argument("--concurrency", type=_positive(int), default=4, metavar="N",
                     help="documents in flight (default %(default)s)")
    run.add_argument("--page-range", type=_page_range, metavar="R",
                     help="0-based pages of each PDF, e.g. 0,5-10 (default all)")
    run.add_argument("--dpi", type=_positive(int), metavar="D",
                     help="PDF render resolution (default: the server's)")
    run.add_argument("--preset", metavar="P",
                     help="prompt preset: markdown (the server's default), ocr, free, figure, describe")
    run.add_argument("--format", type=_formats, default=frozenset(FORMATS), metavar="LIST",
                     help="outputs to write, of md,json,raw (default all three)")
    run.add_argument("--model", metavar="NAME",
                     help="which of the server's models (GET /v1/models; default: its first)")
    run.add_argument("--max-tokens", type=_positive(int), metavar="N",
                     help="token limit per page (default: the server's)")
    run.add_argument("--force", action="store_true", help="redo documents recorded done")
    run.add_argument("--retries", type=_non_negative_int, default=5, metavar="N",
                     help="retries of a transient failure (503, timeout, lost connection) per "
                          "request (default %(default)s)")
    run.add_argument("--timeout", type=_positive(float), default=DEFAULT_TIMEOUT_S, metavar="S",
                     help="seconds to wait for one document's answer (default %(default)g)")
    serve = commands.add_parser(
        "serve", help="start the app: `serve run` in its start-up environment",
        description="`serve run CONFIG_OR_IMPORT_PATH [ARGS...]` with the environment the app's "
                    "Ray cluster needs from its start (preloaded modules; /health and /ready "
                    "answered while the app starts), which a config file cannot set itself")
    serve.add_argument("serve_args", nargs=argparse.REMAINDER, metavar="CONFIG_OR_IMPORT_PATH [ARGS...]")
    batch = commands.add_parser(
        "batch", help="OCR a corpus offline on a Ray cluster (Ray Data), no server", add_help=False,
        description="`python -m deployments.offline_run INPUT... --out DIR [OPTIONS]` (its --help)")
    batch.add_argument("batch_args", nargs=argparse.REMAINDER, metavar="INPUT... --out DIR [OPTIONS]")
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # argparse exits 2 on bad arguments, 0 on --help
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    if args.command == "serve":  # the app's own launcher takes over this process
        os.execv(sys.executable, [sys.executable, "-m", "deployments", *args.serve_args])
    if args.command == "batch":  # the offline run (torch, Ray Data) takes over this process
        os.execv(sys.executable, [sys.executable, "-m", "deployments.offline_run", *args.batch_args])
    try:
        return run_command(args)
    except UsageError as e:
        print(f"deepseek-ocr: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("\ndeepseek-ocr: interrupted; a rerun continues where this one stopped", file=sys.stderr)
        return 130


def run_command(args: argparse.Namespace) -> int:
    inputs = find_inputs(args.inputs, args.out)
    stop = threading.Event()
    client = Client(args.server, args.api_key, args.timeout, args.retries, stop=stop)
    served = client.check_health().get("models")
    if args.model and served is not None and args.model not in served:
        raise UsageError(f"server {args.server} does not serve the model {args.model!r}; it "
                         f"serves {', '.join(served)}")
    options = RunOptions(args.page_range, args.dpi, args.preset, args.max_tokens,
                         args.format, args.force, timeout_s=args.timeout, model=args.model)
    manifest = Manifest(args.out)
    try:
        progress = run_corpus(inputs, client, manifest, options, args.out, args.concurrency)
    finally:
        manifest.close()
    return EXIT_FAILED if progress.failures else EXIT_OK


def run_corpus(inputs: list[Input], client: Client, manifest: Manifest, options: RunOptions,
               out_dir: str, concurrency: int) -> Progress:
    """Plan, OCR what is left, print the summary; returns the progress (its outcomes)."""
    store = StateStore(out_dir)
    work = plan(inputs, manifest, store, options, out_dir)
    progress = Progress(len(work.jobs) + len(work.unreadable),
                        sum(job.estimated_pages for job in work.jobs), work.skipped)
    progress.note(f"{len(inputs)} inputs: {len(work.jobs)} to do, {work.skipped} done before")
    if manifest.skipped_lines:
        progress.note(f"{manifest.path}: skipped {manifest.skipped_lines} unreadable line(s) "
                      f"(a run killed mid-write); those documents are done again")
    for outcome in work.unreadable:
        progress.finished(outcome, 0)
    client.on_retry = progress.note
    try:
        run_jobs(work.jobs, Worker(client, manifest, store, options, out_dir).process,
                 concurrency, progress, client.stop)
    finally:
        client.stop.set()
        progress.finish()
    return progress


def _server_url(text: str) -> str:
    """http(s)://host[:port], without a trailing slash (paths are appended to it)."""
    if not text.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(f"{text!r} is not an http:// or https:// URL")
    return text.rstrip("/")


def _positive(kind):
    def parse(text: str):
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value
    parse.__name__ = kind.__name__  # argparse names the type in its "invalid int value" message
    return parse


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _page_range(text: str) -> str:
    try:
        parse_page_range(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text.replace(" ", "")


def _formats(text: str) -> frozenset[str]:
    chosen = {part.strip() for part in text.split(",") if part.strip()}
    unknown = chosen - set(FORMATS)
    if unknown or not chosen:
        raise argparse.ArgumentTypeError(f"unknown format(s) {', '.join(sorted(unknown)) or text!r}: "
                                         f"choose from {','.join(FORMATS)}")
    return frozenset(chosen)
