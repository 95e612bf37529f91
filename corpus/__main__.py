"""`python -m corpus run ...`: the same as the `deepseek-ocr` console script."""
import sys

from .cli import main

sys.exit(main())
