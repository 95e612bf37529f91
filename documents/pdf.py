"""Open a PDF and render its pages one at a time with PDFium (pypdfium2's raw bindings).

PDFium is not thread-safe, so every PDFium call in this module goes through one module-level lock
(as MinerU does): callers may render from several threads, and renders of any documents run one
at a time. Pages and bitmaps are freed right after each render, and the document is reopened
every _PAGES_PER_OPEN pages, so memory does not grow with the number of pages rendered.

Raw FPDF_* calls rather than pypdfium2's helper classes: those free their handles in garbage-
collector finalizers, outside any lock; their page.render() sizes bitmaps by ceil(points * scale)
with no tolerance for float error; and their open reads FPDF_GetLastError() even after a
successful load, which does not reset it.
"""
from __future__ import annotations

import atexit
import ctypes
import math
import os
import threading
import weakref

import pypdfium2.raw as pdfium_c
from PIL import Image

from .errors import CorruptDocument, DocumentError, EncryptedDocument, TooManyPages
from .page_range import page_out_of_range

__all__ = ["DEFAULT_DPI", "MAX_DPI", "MAX_PAGE_PIXELS", "MIN_DPI", "PdfDocument"]

# Same decompression-bomb limit (width * height) as the encoder's image limit,
# encoder.preprocess.MAX_IMAGE_PIXELS (not imported: encoder/ imports torch).
MAX_PAGE_PIXELS = 64_000_000
DEFAULT_DPI = 144  # DeepSeek's run_dpsk_ocr_pdf.py; its paper's benchmark used 200
MIN_DPI, MAX_DPI = 72, 300
_PAGES_PER_OPEN = 50  # pages loaded before the document is reopened (see render)

# Reentrant because close() also runs from __del__, which the garbage collector may call in a
# thread that already holds the lock (in the middle of a render); a plain Lock would deadlock.
_PDFIUM_LOCK = threading.RLock()

# Documents not closed yet. pypdfium2 destroys the library at exit (its own atexit handler, which
# closes only its helper objects); a handle of ours closed after that, by a document's __del__
# as the interpreter tears down, crashed the process (SIGSEGV). Exit handlers run last-registered
# first, and this module registers after importing pypdfium2: open documents close before it.
_OPEN_DOCUMENTS: weakref.WeakSet[PdfDocument] = weakref.WeakSet()


@atexit.register
def _close_open_documents() -> None:
    with _PDFIUM_LOCK:
        open_documents = list(_OPEN_DOCUMENTS)
    for document in open_documents:
        document.close()

# FPDF_GetLastError() after a failed load (only then: a successful load leaves it stale).
_OPEN_ERRORS = {
    pdfium_c.FPDF_ERR_UNKNOWN: "PDFium failed with an unknown error",
    pdfium_c.FPDF_ERR_FILE: "the file cannot be read (PDFium: file access error)",
    pdfium_c.FPDF_ERR_FORMAT: "the data is not a PDF, or it is damaged or truncated "
                              "(PDFium: data format error)",
    pdfium_c.FPDF_ERR_PAGE: "its pages cannot be found (PDFium: page not found or content error)",
}


class PdfDocument:
    """A PDF opened from bytes or a path; `render(i)` rasterises page i to an RGB image.

    Raises EncryptedDocument, CorruptDocument or TooManyPages (more than `max_pages` pages).
    Close it, or use it in a `with` block.
    """

    def __init__(self, data: bytes | bytearray | memoryview | str | os.PathLike,
                 max_pages: int | None = None):
        self._handle = None
        if isinstance(data, (bytes, bytearray, memoryview)):
            source = bytes(data)
            if not source:
                raise CorruptDocument("not a readable PDF: the data is empty")
        elif isinstance(data, (str, os.PathLike)):
            source = os.fspath(data)
            if not os.path.isfile(source):
                raise DocumentError(f"PDF file not found: {source!r}")
        else:
            raise TypeError(f"a PDF is bytes or a path, not {type(data).__name__}")
        with _PDFIUM_LOCK:
            handle = _load(source)
            page_count = pdfium_c.FPDF_GetPageCount(handle)
            if page_count < 1:
                pdfium_c.FPDF_CloseDocument(handle)
                raise CorruptDocument("not a readable PDF: it has no pages")
        # PDFium reads the bytes in place, for as long as the document is open.
        self._handle, self._source, self.page_count = handle, source, page_count
        self._pages_loaded = 0
        with _PDFIUM_LOCK:
            _OPEN_DOCUMENTS.add(self)
        if max_pages is not None and page_count > max_pages:
            self.close()
            raise TooManyPages(page_count, max_pages)

    def page_size(self, index: int) -> tuple[float, float]:
        """(width, height) of page `index` in points (1/72 inch), after its /Rotate."""
        self._check_index(index)
        size = pdfium_c.FS_SIZEF()
        with _PDFIUM_LOCK:
            if not pdfium_c.FPDF_GetPageSizeByIndexF(self._open(), index, ctypes.byref(size)):
                raise _unreadable_page(index)
        return size.width, size.height

    def render(self, index: int, dpi: float = DEFAULT_DPI,
               max_pixels: int = MAX_PAGE_PIXELS) -> Image.Image:
        """Page `index` as an RGB image on white, at `dpi` (scale dpi/72, as DeepSeek's script).

        The pixel size is ceil(points * dpi / 72 - 0.001), PyMuPDF's rounding (fz_round_rect),
        so the image has the size DeepSeek's PyMuPDF script gives it.
        """
        _check_dpi(dpi)
        self._check_index(index)
        with _PDFIUM_LOCK:
            handle = self._open()
            if self._pages_loaded >= _PAGES_PER_OPEN:
                # A document keeps the parsed objects of every page it loaded until it is
                # closed (fonts; image streams, about a scan's compressed size per page):
                # 300 scanned pages peaked at 101 MB without reopening, 74 MB with it.
                pdfium_c.FPDF_CloseDocument(handle)
                self._handle = None  # stays closed if the file went away meanwhile
                self._handle = handle = _load(self._source)
                self._pages_loaded = 0
            self._pages_loaded += 1
            page = pdfium_c.FPDF_LoadPage(handle, index)
            if not page:
                raise _unreadable_page(index)
            try:
                width = _pixels(pdfium_c.FPDF_GetPageWidthF(page), dpi)
                height = _pixels(pdfium_c.FPDF_GetPageHeightF(page), dpi)
                if width * height > max_pixels:
                    raise DocumentError(
                        f"page {index} is too large to render at {dpi} dpi: {width}x{height} "
                        f"pixels, more than the limit of {max_pixels}; use a lower dpi")
                return _render_page(page, width, height)
            finally:
                pdfium_c.FPDF_ClosePage(page)

    def text(self, index: int) -> str:
        """Page `index`'s text layer: the text the PDF itself holds (pdfium's text page, in its
        reading order), "" for a page without one (a scan)."""
        self._check_index(index)
        with _PDFIUM_LOCK:
            page = pdfium_c.FPDF_LoadPage(self._open(), index)
            if not page:
                raise _unreadable_page(index)
            try:
                text_page = pdfium_c.FPDFText_LoadPage(page)
                if not text_page:
                    return ""
                try:
                    count = pdfium_c.FPDFText_CountChars(text_page)
                    if count <= 0:
                        return ""
                    buffer = ctypes.create_string_buffer(2 * (count + 1))  # UTF-16, and its NUL
                    written = pdfium_c.FPDFText_GetText(text_page, 0, count,
                                                        ctypes.cast(buffer, ctypes.POINTER(ctypes.c_ushort)))
                    return buffer.raw[:2 * max(0, written - 1)].decode("utf-16-le", errors="replace")
                finally:
                    pdfium_c.FPDFText_ClosePage(text_page)
            finally:
                pdfium_c.FPDF_ClosePage(page)

    def close(self) -> None:
        with _PDFIUM_LOCK:
            if self._handle is not None:
                pdfium_c.FPDF_CloseDocument(self._handle)
                self._handle = self._source = None
            _OPEN_DOCUMENTS.discard(self)

    def __enter__(self) -> PdfDocument:
        return self

    def __exit__(self, *_) -> None:
        self.close()

    def __del__(self):
        # A document never closed is closed here, under the lock, by whichever thread drops it.
        if getattr(self, "_handle", None) is not None:
            self.close()

    def _open(self):
        if self._handle is None:
            raise ValueError("the PDF document is closed")
        return self._handle

    def _check_index(self, index: int) -> None:
        if not 0 <= index < self.page_count:
            raise page_out_of_range(index, self.page_count)


def _load(source: bytes | str):
    """An FPDF_DOCUMENT handle for `source`. Caller holds _PDFIUM_LOCK."""
    if isinstance(source, bytes):
        handle = pdfium_c.FPDF_LoadMemDocument64(source, len(source), None)
    else:
        handle = pdfium_c.FPDF_LoadDocument(os.fsencode(source), None)
    if not handle:
        raise _open_error(pdfium_c.FPDF_GetLastError())
    return handle


def _open_error(err_code: int) -> DocumentError:
    if err_code == pdfium_c.FPDF_ERR_PASSWORD:
        return EncryptedDocument("the PDF is encrypted (password-protected): it cannot be opened "
                                 "without its password; remove the password and send it again")
    if err_code == pdfium_c.FPDF_ERR_SECURITY:
        return EncryptedDocument("the PDF is encrypted (password-protected): its security handler "
                                 "is not supported; remove the encryption and send it again")
    reason = _OPEN_ERRORS.get(err_code, f"PDFium failed with error code {err_code}")
    return CorruptDocument(f"not a readable PDF: {reason}")


def _unreadable_page(index: int) -> DocumentError:
    return DocumentError(f"page {index} cannot be read: PDFium failed to load it "
                         "(the page is damaged)")


def _check_dpi(dpi: float) -> None:
    if isinstance(dpi, bool) or not isinstance(dpi, (int, float)) or not MIN_DPI <= dpi <= MAX_DPI:
        raise DocumentError(f"dpi must be a number from {MIN_DPI} to {MAX_DPI}, got {dpi!r}")


def _pixels(points: float, dpi: float) -> int:
    # The tolerance absorbs float error: 612 pt at 88 dpi computes as 748.0000000000001, and is
    # 748 pixels, not 749.
    return max(1, math.ceil(points * dpi / 72 - 0.001))


def _render_page(page, width: int, height: int) -> Image.Image:
    """Rasterise `page` to exactly width x height pixels. Caller holds _PDFIUM_LOCK."""
    stride = width * 3
    buffer = (ctypes.c_ubyte * (stride * height))()
    bitmap = pdfium_c.FPDFBitmap_CreateEx(width, height, pdfium_c.FPDFBitmap_BGR, buffer, stride)
    if not bitmap:
        raise MemoryError(f"PDFium could not create a {width}x{height} bitmap")
    try:
        pdfium_c.FPDFBitmap_FillRect(bitmap, 0, 0, width, height, 0xFFFFFFFF)  # white, opaque
        pdfium_c.FPDF_RenderPageBitmap(bitmap, page, 0, 0, width, height, 0, pdfium_c.FPDF_ANNOT)
    finally:
        pdfium_c.FPDFBitmap_Destroy(bitmap)  # the buffer is ours: destroy frees only the header
    # frombytes copies (and turns BGR into RGB): the image does not hold on to `buffer`.
    return Image.frombytes("RGB", (width, height), buffer, "raw", "BGR", stride, 1)
