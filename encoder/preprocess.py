"""DeepSeek-OCR image preprocessing: decode an image and cut it into model views.

This reproduces the reference preprocessing of DeepSeek-OCR (its HF
``dynamic_preprocess`` / ``find_closest_aspect_ratio`` and the view modes of
the vLLM / SGLang integrations) so that the encoder sees exactly the pixels the
model was trained on.  Outputs are uint8 tensors; normalisation to [-1, 1]
happens later, on the encoder's device (see :func:`normalize`).

Plain Python + PIL + numpy + torch on purpose: this runs in request handlers
and must not depend on Ray or on the model code.

The public names, one import away; each job lives in its own module, in this order (each
imports only those before it):
  tiling.py    modes, grids, token counts per model family (`Tiling`), `ImageError`;
  decoding.py  bytes / paths / PIL images -> oriented RGB or grey pixels (`decode`);
  headers.py   a PNG's or JPEG's sizes from its header alone (`read_header`, `decode_header`);
  views.py     the global view and crops, by PIL (`preprocess`) or tensor maths (`views_of`).
"""

from .decoding import MAX_IMAGE_PIXELS, DecodedImage, decode, load_image, page_locked
from .decoding import _grey_channel  # noqa: F401 - tests import it from here
from .headers import ImageHeader, decode_header, read_header
from .tiling import (CROP_SIZE, DEEPSEEK_OCR, DEEPSEEK_OCR_2, DEFAULT_MAX_CROPS, MAX_CROPS_LIMIT, MODES,
                     ImageError, Tiling, ViewMode, candidate_grids, check_view_options, choose_grid,
                     count_tokens)
from .tiling import _reference_candidates  # noqa: F401 - tests import it from here
from .views import (PendingImage, PreprocessedImage, crops_of, global_view_of, normalize, preprocess,
                    start_preprocess, views_of)

__all__ = [
    "CROP_SIZE",
    "DEEPSEEK_OCR",
    "DEEPSEEK_OCR_2",
    "DEFAULT_MAX_CROPS",
    "DecodedImage",
    "ImageHeader",
    "MAX_CROPS_LIMIT",
    "MAX_IMAGE_PIXELS",
    "MODES",
    "ImageError",
    "PendingImage",
    "PreprocessedImage",
    "Tiling",
    "ViewMode",
    "candidate_grids",
    "check_view_options",
    "choose_grid",
    "count_tokens",
    "crops_of",
    "decode",
    "decode_header",
    "global_view_of",
    "load_image",
    "normalize",
    "page_locked",
    "preprocess",
    "read_header",
    "start_preprocess",
    "views_of",
]
