"""Errors for bad PDFs and page ranges. Their messages go verbatim into HTTP error bodies, so
they say what is wrong in words a client can act on; `status` is the HTTP status to answer and
`param` the request field at fault."""
from __future__ import annotations


class DocumentError(ValueError):
    """Every problem with a client's PDF or page range (ValueError: it is bad input)."""

    status = 400
    param = "document"


class EncryptedDocument(DocumentError):
    """The PDF needs a password to be opened."""


class CorruptDocument(DocumentError):
    """The data is not a PDF that PDFium can read (garbage, truncated, no pages)."""


class TooManyPages(DocumentError):
    """The PDF has more pages than one request may carry."""

    status = 413

    def __init__(self, page_count: int, limit: int):
        super().__init__(f"the PDF has {page_count} pages, more than the limit of {limit} "
                         "pages per document; split it into smaller documents")
        self.page_count = page_count
        self.limit = limit


class PageRangeError(DocumentError):
    """A page range that cannot be read or names pages the document does not have."""

    param = "page_range"
