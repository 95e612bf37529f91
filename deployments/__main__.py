"""`python -m deployments CONFIG_OR_IMPORT_PATH [ARGS...]` (also `deepseek-ocr serve ...`):
`serve run` in the app's start-up environment (`STARTUP_ENVIRONMENT`), which a config file
cannot set itself: `serve run deployments/configs/x.yaml` starts Ray before it reads the app.
What the caller's environment already sets is kept."""
import os
import sys

from . import STARTUP_ENVIRONMENT


def main(argv: list[str]) -> None:
    # Serve's command line on this interpreter (its `serve` script may be elsewhere on PATH)
    command = [sys.executable, "-m", "ray.serve.scripts", "run", *argv]
    os.execve(sys.executable, command, {**STARTUP_ENVIRONMENT, **os.environ})


if __name__ == "__main__":
    main(sys.argv[1:])
