"""`python -m deployments CONFIG_OR_IMPORT_PATH [ARGS...]` (also `deepseek-ocr serve ...`):
`serve run` in the app's start-up environment (`STARTUP_ENVIRONMENT`), which a config file
cannot set itself: `serve run deployments/configs/x.yaml` starts Ray before it reads the app.
What the caller's environment already sets is kept. The checkpoints the config names are read
into the page cache meanwhile (deployments/prefetch.py; DEEPSEEK_OCR_PREFETCH_CHECKPOINT=0: not)."""
import os
import sys

from common import switches

from . import STARTUP_ENVIRONMENT, prefetch


def main(argv: list[str]) -> None:
    if switches.on("DEEPSEEK_OCR_PREFETCH_CHECKPOINT"):  # read while Ray and Serve start
        prefetch.start(prefetch.checkpoint_dirs(argv))
    # Serve's command line on this interpreter (its `serve` script may be elsewhere on PATH)
    command = [sys.executable, "-m", "ray.serve.scripts", "run", *argv]
    os.execve(sys.executable, command, {**STARTUP_ENVIRONMENT, **os.environ})


if __name__ == "__main__":
    main(sys.argv[1:])
