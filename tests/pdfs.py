"""Test PDFs made on the fly: real multi-page documents, an encrypted one and a corrupt one.

Not a test file: other tests import `make_pdf`, `encrypted_pdf` and `corrupt_pdf`. Pages are drawn
with pypdfium2's raw FPDF API (pdfium can write documents but not encrypt them, so the encrypted
PDF is written by hand with the standard security handler).
"""
from __future__ import annotations

import ctypes
import hashlib
import io

import pypdfium2 as pdfium
import pypdfium2.raw as pdfium_c

# Fill colour of page i's marker rectangle, and where it sits: both depend on i, so pages differ.
MARKER_SIZE = 40  # points
MARKER_COLORS = [(220, 30, 30), (30, 160, 30), (30, 60, 220)]


def marker_box(index: int, size: tuple[float, float]) -> tuple[float, float, float, float]:
    """(left, top, right, bottom) of page `index`'s rectangle, in points from the top left."""
    width, height = size
    slots_x = max(1, int((width - MARKER_SIZE) // MARKER_SIZE))
    left = (index % slots_x) * MARKER_SIZE
    top = (index // slots_x) % max(1, int((height / 2) // MARKER_SIZE)) * MARKER_SIZE
    return left, top, left + MARKER_SIZE, top + MARKER_SIZE


def marker_color(index: int) -> tuple[int, int, int]:
    return MARKER_COLORS[index % len(MARKER_COLORS)]


def make_pdf(n_pages: int, size: tuple[float, float] = (612, 792), text: bool = True) -> bytes:
    """A real `n_pages`-page PDF: page i has a filled rectangle at `marker_box(i, size)` in
    `marker_color(i)` and, with `text`, the line "Page i" in Helvetica in its lower half."""
    pdf = pdfium.PdfDocument.new()
    try:
        # Pages are drawn in small scratch documents and imported: pdfium's GenerateContent
        # slows down as its document grows (1,000 pages in one document took 7 s, not 0.3 s).
        for start in range(0, n_pages, _CHUNK_PAGES):
            scratch = pdfium.PdfDocument.new()
            for index in range(start, min(start + _CHUNK_PAGES, n_pages)):
                _draw_page(scratch, index, size, text)
            pdf.import_pages(scratch)
            scratch.close()
        buffer = io.BytesIO()
        pdf.save(buffer)
        return buffer.getvalue()
    finally:
        pdf.close()


_CHUNK_PAGES = 50


def _draw_page(pdf: pdfium.PdfDocument, index: int, size: tuple[float, float], text: bool) -> None:
    width, height = size
    page = pdf.new_page(width, height)
    left, top, right, bottom = marker_box(index, size)
    # PDF coordinates start at the bottom-left corner.
    rect = pdfium_c.FPDFPageObj_CreateNewRect(left, height - bottom, right - left, bottom - top)
    pdfium_c.FPDFPageObj_SetFillColor(rect, *marker_color(index), 255)
    pdfium_c.FPDFPath_SetDrawMode(rect, pdfium_c.FPDF_FILLMODE_ALTERNATE, False)
    pdfium_c.FPDFPage_InsertObject(page, rect)  # the page owns it now
    if text:
        label = pdfium_c.FPDFPageObj_NewTextObj(pdf, b"Helvetica", min(24.0, height / 8))
        encoded = f"Page {index}\x00".encode("utf-16-le")
        pdfium_c.FPDFText_SetText(label, ctypes.cast(encoded, pdfium_c.FPDF_WIDESTRING))
        pdfium_c.FPDFPageObj_Transform(label, 1, 0, 0, 1, 10, height / 4)
        pdfium_c.FPDFPage_InsertObject(page, label)
    page.gen_content()
    page.close()


def corrupt_pdf() -> bytes:
    """A PDF header followed by garbage: no objects, no xref, nothing pdfium can repair."""
    return b"%PDF-1.7\n" + bytes(range(256)) * 8 + b"\n%%EOF\n"


# --- encryption (PDF 1.7 spec, 7.6.3: standard security handler, revision 2, 40-bit RC4) ---
_PASSWORD_PAD = bytes.fromhex(
    "28bf4e5e4e758a4164004e56fffa01082e2e00b6d0683e802f0ca9fe6453697a")


def _rc4(key: bytes, data: bytes) -> bytes:
    s = list(range(256))
    j = 0
    for i in range(256):
        j = (j + s[i] + key[i % len(key)]) % 256
        s[i], s[j] = s[j], s[i]
    out, i, j = bytearray(), 0, 0
    for byte in data:
        i = (i + 1) % 256
        j = (j + s[i]) % 256
        s[i], s[j] = s[j], s[i]
        out.append(byte ^ s[(s[i] + s[j]) % 256])
    return bytes(out)


def _padded(password: str) -> bytes:
    return (password.encode("latin-1") + _PASSWORD_PAD)[:32]


def encrypted_pdf(user_password: str = "secret", owner_password: str = "owner") -> bytes:
    """A one-page PDF encrypted with a non-empty user password: pdfium refuses it without
    the password (FPDF_ERR_PASSWORD) and opens it with `user_password`."""
    file_id = hashlib.md5(b"deepseek-ocr-serve test").digest()
    permissions = -4  # every permission bit set
    owner_key = hashlib.md5(_padded(owner_password)).digest()[:5]  # algorithm 3
    o_entry = _rc4(owner_key, _padded(user_password))
    file_key = hashlib.md5(_padded(user_password) + o_entry
                           + permissions.to_bytes(4, "little", signed=True) + file_id).digest()[:5]
    u_entry = _rc4(file_key, _PASSWORD_PAD)  # algorithm 4 (revision 2)
    objects = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
        b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 200 300] >>",
        b"<< /Filter /Standard /V 1 /R 2 /O <%s> /U <%s> /P %d >>"
        % (o_entry.hex().encode(), u_entry.hex().encode(), permissions),
    ]
    out = bytearray(b"%PDF-1.4\n")
    offsets = []
    for number, body in enumerate(objects, start=1):
        offsets.append(len(out))
        out += b"%d 0 obj\n%s\nendobj\n" % (number, body)
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    out += b"".join(b"%010d 00000 n \n" % offset for offset in offsets)
    out += (b"trailer\n<< /Size %d /Root 1 0 R /Encrypt 4 0 R /ID [<%s> <%s>] >>\n"
            % (len(objects) + 1, file_id.hex().encode(), file_id.hex().encode()))
    out += b"startxref\n%d\n%%%%EOF\n" % xref
    return bytes(out)
