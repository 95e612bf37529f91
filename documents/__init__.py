"""PDF documents: page ranges and page rendering with pypdfium2 (plain Python, no torch, no Ray)."""
from .errors import CorruptDocument, DocumentError, EncryptedDocument, PageRangeError, TooManyPages
from .feeder import map_pages
from .page_range import parse_page_range
from .pdf import DEFAULT_DPI, MAX_DPI, MAX_PAGE_PIXELS, MIN_DPI, PdfDocument

__all__ = [
    "DEFAULT_DPI",
    "MAX_DPI",
    "MAX_PAGE_PIXELS",
    "MIN_DPI",
    "CorruptDocument",
    "DocumentError",
    "EncryptedDocument",
    "PageRangeError",
    "PdfDocument",
    "TooManyPages",
    "map_pages",
    "parse_page_range",
]
