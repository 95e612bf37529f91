"""documents/: page ranges, opening and rendering PDFs with PDFium, the bounded page feeder."""
import asyncio
import contextlib
import io
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pypdfium2 as pdfium
import pytest
from hypothesis import given
from hypothesis import strategies as st

from documents import (CorruptDocument, DocumentError, EncryptedDocument, PageRangeError,
                       PdfDocument, TooManyPages, map_pages, parse_page_range)
from tests.pdfs import corrupt_pdf, encrypted_pdf, make_pdf, marker_box, marker_color

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = (200, 300)  # points: small pages keep renders fast


@pytest.fixture(scope="module")
def five_pages():
    return make_pdf(5, SMALL)


# --- page ranges -------------------------------------------------------------------------------

@pytest.mark.parametrize("spec, page_count, expected", [
    ("0,5-10,20", 25, [0, 5, 6, 7, 8, 9, 10, 20]),
    (" 3 , 1 - 2 ,1", 5, [1, 2, 3]),
    ("4,0", 5, [0, 4]),
    ("2-2", 5, [2]),
    ("0-4,1-3,3", 5, [0, 1, 2, 3, 4]),
    ("007", 10, [7]),
    (None, 3, [0, 1, 2]),
    ("", 3, [0, 1, 2]),
    ("   ", 3, [0, 1, 2]),
])
def test_page_range(spec, page_count, expected):
    assert parse_page_range(spec, page_count) == expected


@pytest.mark.parametrize("spec, words", [
    ("a", ["'a' is not a page number"]),
    ("1-x", ["'x' is not a page number"]),
    ("1.5", ["not a page number"]),
    ("+1", ["not a page number"]),
    ("1-2-3", ["not a page number"]),
    ("10-5", ["'10-5' is reversed", "'5-10'"]),
    ("0-25", ["page 25 is out of range", "25 pages", "0-24"]),
    ("30", ["page 30 is out of range"]),
    ("9" * 5000, ["out of range"]),  # past int()'s 4,300-digit limit
    ("0,,1", ["empty part"]),
    ("1,", ["empty part"]),
    ("-5", ["lacks a page number"]),
    ("5-", ["lacks a page number"]),
])
def test_page_range_errors_name_the_problem(spec, words):
    with pytest.raises(PageRangeError) as caught:
        parse_page_range(spec, 25)
    message = str(caught.value)
    assert all(word in message for word in words), message
    assert len(message) < 200  # a client's long spec is cut, not echoed whole
    assert isinstance(caught.value, DocumentError) and caught.value.status == 400


@given(st.lists(st.tuples(st.integers(0, 29), st.integers(0, 29)), min_size=1, max_size=12))
def test_page_range_is_the_union_of_its_parts(spans):
    spec = ",".join(f"{min(a, b)}-{max(a, b)}" if a != b else str(a) for a, b in spans)
    expected = sorted({p for a, b in spans for p in range(min(a, b), max(a, b) + 1)})
    assert parse_page_range(spec, 30) == expected


# --- opening -----------------------------------------------------------------------------------

def test_page_count_and_size_of_a_non_square_page():
    with PdfDocument(make_pdf(3, (601, 397))) as document:
        assert document.page_count == 3
        assert document.page_size(2) == (601, 397)


def test_encrypted_pdf_is_refused_with_a_clear_message():
    with pytest.raises(EncryptedDocument) as caught:
        PdfDocument(encrypted_pdf())
    assert str(caught.value).startswith("the PDF is encrypted (password-protected): ")
    assert caught.value.status == 400
    # Really encrypted, not merely broken: PDFium opens it with its password.
    assert len(pdfium.PdfDocument(encrypted_pdf(), password="secret")) == 1


@pytest.mark.parametrize("data", [
    corrupt_pdf(),
    make_pdf(10, SMALL)[:3000],  # truncated (of 6 kB): PDFium does not repair it
    b"<html><body>not a pdf</body></html>",
    b"",
], ids=["garbage", "truncated", "html", "empty"])
def test_corrupt_pdf_is_refused(data):
    with pytest.raises(CorruptDocument) as caught:
        PdfDocument(data)
    assert str(caught.value).startswith("not a readable PDF: ")
    assert caught.value.status == 400


def test_pdf_without_pages_is_refused():
    empty = pdfium.PdfDocument.new()
    buffer = io.BytesIO()
    empty.save(buffer)
    empty.close()
    with pytest.raises(CorruptDocument, match="no pages"):
        PdfDocument(buffer.getvalue())


def test_too_many_pages_is_413(five_pages):
    with pytest.raises(TooManyPages) as caught:
        PdfDocument(five_pages, max_pages=4)
    assert caught.value.status == 413
    assert "5 pages" in str(caught.value) and "limit of 4" in str(caught.value)
    with PdfDocument(five_pages, max_pages=5) as document:
        assert document.page_count == 5


def test_opens_from_a_path(tmp_path, five_pages):
    path = tmp_path / "doc.pdf"
    path.write_bytes(five_pages)
    with PdfDocument(path) as document:
        assert document.page_count == 5
        assert document.render(4, dpi=72).size == SMALL
    with pytest.raises(DocumentError, match="not found"):
        PdfDocument(tmp_path / "missing.pdf")


def test_pages_render_right_across_reopens(tmp_path, monkeypatch):
    """The document is reopened every few pages (to drop PDFium's caches), from bytes or a path."""
    monkeypatch.setattr("documents.pdf._PAGES_PER_OPEN", 7)
    path = tmp_path / "doc.pdf"
    path.write_bytes(make_pdf(30, SMALL, text=False))
    for source in (path, path.read_bytes()):
        with PdfDocument(source) as document:
            for index in [*range(30), 3, 29, 0]:
                left, top, right, bottom = marker_box(index, SMALL)
                image = document.render(index, dpi=72)
                assert image.getpixel(((left + right) // 2, (top + bottom) // 2)) == \
                    marker_color(index)


def test_closed_document_refuses_to_render(five_pages):
    document = PdfDocument(five_pages)
    document.close()
    document.close()  # twice is fine
    with pytest.raises(ValueError, match="closed"):
        document.render(0)


LEFT_OPEN = """
from documents import PdfDocument
from tests.pdfs import make_pdf
kept = PdfDocument(make_pdf(3))  # never closed: a caller that forgot, or one stopped mid-document
kept.render(0)
print(kept.page_count)
"""


def test_a_document_left_open_at_exit_does_not_crash_the_process():
    """pypdfium2 destroys the library at exit; a document still open then is closed before it,
    not by its __del__ afterwards (that crashed the interpreter with SIGSEGV)."""
    run = subprocess.run([sys.executable, "-c", LEFT_OPEN], cwd=ROOT, capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=ROOT), timeout=60)
    assert run.returncode == 0 and run.stdout.split() == ["3"], (run.returncode, run.stderr[-2000:])


# --- rendering ---------------------------------------------------------------------------------

# ceil(points * dpi / 72 - 0.001), PyMuPDF's rounding: 601 pt at 200 dpi is 1669.4 -> 1670.
@pytest.mark.parametrize("dpi, expected", [(72, (601, 397)), (144, (1202, 794)),
                                           (200, (1670, 1103))])
def test_render_size_follows_dpi(dpi, expected):
    with PdfDocument(make_pdf(1, (601, 397))) as document:
        image = document.render(0, dpi=dpi)
    assert image.mode == "RGB" and image.size == expected


def test_render_size_has_no_float_error():
    """612 * (88 / 72) is 748.0000000000001 in floats: pypdfium2's page.render gives 749x969."""
    with PdfDocument(make_pdf(1, (612, 792), text=False)) as document:
        assert document.render(0, dpi=88).size == (748, 968)


def test_rotated_page_renders_rotated():
    source = pdfium.PdfDocument(make_pdf(1, SMALL, text=False))
    source[0].set_rotation(90)
    buffer = io.BytesIO()
    source.save(buffer)
    source.close()
    with PdfDocument(buffer.getvalue()) as document:
        assert document.page_size(0) == (300, 200)
        assert document.render(0, dpi=72).size == (300, 200)


@pytest.mark.parametrize("index", [0, 4])
def test_render_shows_the_page(five_pages, index):
    with PdfDocument(five_pages) as document:
        image = document.render(index, dpi=72)
    left, top, right, bottom = marker_box(index, SMALL)
    red, green, blue = image.getpixel(((left + right) // 2, (top + bottom) // 2))
    assert all(abs(a - b) <= 2 for a, b in zip((red, green, blue), marker_color(index)))
    assert image.getpixel((SMALL[0] - 2, 2)) == (255, 255, 255)  # white background
    # The "Page i" text: dark pixels in the lower half.
    lower_half = image.crop((0, SMALL[1] // 2, SMALL[0], SMALL[1])).convert("L")
    assert min(lower_half.getdata()) < 80


@pytest.mark.parametrize("dpi", [71, 301, 0, -144, 1e9, float("nan"), True, "144", None])
def test_dpi_out_of_range_is_refused(five_pages, dpi):
    with PdfDocument(five_pages) as document, pytest.raises(DocumentError, match="dpi"):
        document.render(0, dpi=dpi)


def test_render_refuses_a_page_past_the_pixel_cap(five_pages):
    with PdfDocument(five_pages) as document:
        with pytest.raises(DocumentError, match="too large to render at 144 dpi: 400x600"):
            document.render(0, dpi=144, max_pixels=400 * 600 - 1)
        assert document.render(0, dpi=144, max_pixels=400 * 600).size == (400, 600)


def test_render_out_of_range_page(five_pages):
    with PdfDocument(five_pages) as document, pytest.raises(PageRangeError, match="5 pages"):
        document.render(5)


def test_render_from_four_threads_matches_one_thread():
    data = make_pdf(8, (300, 400))
    with PdfDocument(data) as document:
        alone = [document.render(i, dpi=100).tobytes() for i in range(8)]
        with ThreadPoolExecutor(4) as pool:
            together = list(pool.map(lambda i: document.render(i % 8, dpi=100).tobytes(),
                                     range(32)))
    assert together == alone * 4


# --- the page feeder ---------------------------------------------------------------------------

def collect(document, indices, work, window, dpi=72):
    async def main():
        return [item async for item in map_pages(document, indices, dpi, work, window)]
    return asyncio.run(main())


@pytest.mark.parametrize("window", [1, 3])
def test_map_pages_yields_in_order_with_bounded_concurrency(window):
    indices = [0, 2, 3, 5, 6, 7, 9]
    in_flight = peak = 0
    first_wave = asyncio.Event()

    async def work(index, image):
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        if in_flight == window:
            first_wave.set()
        if index in indices[:window]:  # the first window of pages all run before any is yielded
            await asyncio.wait_for(first_wave.wait(), timeout=10)
        await asyncio.sleep(0.001 * (10 - index))  # later pages finish first
        in_flight -= 1
        return index, image.size

    with PdfDocument(make_pdf(10, SMALL)) as document:
        results = collect(document, indices, work, window)
    assert results == [(i, (i, SMALL)) for i in indices]
    assert peak == window


def test_map_pages_never_holds_more_than_window_pages():
    """Counted from render start to hand-over, with a slow consumer."""
    window, rendering_started, handed_over, peak = 2, 0, 0, 0

    with PdfDocument(make_pdf(8, SMALL)) as document:
        render = document.render

        def counted_render(index, dpi):
            nonlocal rendering_started, peak
            rendering_started += 1
            peak = max(peak, rendering_started - handed_over)
            return render(index, dpi)

        async def work(index, image):
            return index

        async def main():
            nonlocal handed_over
            async for _ in map_pages(document, list(range(8)), 72, work, window):
                handed_over += 1
                await asyncio.sleep(0.005)  # pages must not pile up behind a slow consumer

        document.render = counted_render
        asyncio.run(main())
    assert handed_over == 8 and peak == window


def test_map_pages_yields_a_failed_page_and_carries_on():
    async def work(index, image):
        if index == 2:
            raise RuntimeError("replica lost")
        return index

    with PdfDocument(make_pdf(5, SMALL)) as document:
        # page 9 does not exist: its render fails, the others do not
        results = collect(document, [0, 1, 2, 3, 9, 4], work, window=2)
    assert [index for index, _ in results] == [0, 1, 2, 3, 9, 4]
    outcomes = dict(results)
    assert isinstance(outcomes[2], RuntimeError) and str(outcomes[2]) == "replica lost"
    assert isinstance(outcomes[9], PageRangeError)
    assert [outcomes[i] for i in (0, 1, 3, 4)] == [0, 1, 3, 4]


def test_map_pages_stopped_early_leaves_no_tasks():
    async def work(index, image):
        await asyncio.sleep(0 if index < 2 else 10)
        return index

    async def main(document):
        async with contextlib.aclosing(map_pages(document, list(range(20)), 72, work, 4)) as pages:
            first = [await anext(pages), await anext(pages)]
        return first, asyncio.all_tasks() - {asyncio.current_task()}

    with PdfDocument(make_pdf(20, SMALL)) as document:
        first, left = asyncio.run(main(document))
    assert first == [(0, 0), (1, 1)]
    assert not left


def test_map_pages_consumer_cancelled_leaves_no_tasks():
    async def work(index, image):
        await asyncio.sleep(10)

    async def consume(document):
        async for _ in map_pages(document, list(range(10)), 72, work, 3):
            pass

    async def main(document):
        consumer = asyncio.create_task(consume(document))
        await asyncio.sleep(0.05)
        consumer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await consumer
        return asyncio.all_tasks() - {asyncio.current_task()}

    with PdfDocument(make_pdf(10, SMALL)) as document:
        assert not asyncio.run(main(document))


# Runs in a fresh interpreter so that the peak RSS is this feeder's alone.
MEMORY_PROBE = """
import asyncio, sys
from documents import PdfDocument, map_pages

async def thumbnail(index, image):
    image.thumbnail((32, 32))  # image-sized work
    return image.size

async def main(data):
    with PdfDocument(data) as document:
        pages = list(range(document.page_count))
        done = [r async for _, r in map_pages(document, pages, 144, thumbnail, window=4)]
    assert len(done) == len(pages) and all(isinstance(r, tuple) for r in done), done[:3]

asyncio.run(main(open(sys.argv[1], "rb").read()))
# VmHWM, not getrusage's ru_maxrss: that one keeps the parent's peak across fork + exec.
print(next(line.split()[1] for line in open("/proc/self/status") if line.startswith("VmHWM:")))
"""


def peak_rss_mb(tmp_path, n_pages):
    path = tmp_path / f"{n_pages}.pdf"
    path.write_bytes(make_pdf(n_pages, SMALL))
    out = subprocess.run([sys.executable, "-c", MEMORY_PROBE, str(path)], cwd=ROOT,
                         capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1]) / 1024  # kB -> MB


def test_map_pages_memory_does_not_grow_with_page_count(tmp_path):
    """1,000 pages at 144 dpi (400x600 RGB, 0.7 MB each; 0.7 GB if they were all kept)."""
    small, large = peak_rss_mb(tmp_path, 100), peak_rss_mb(tmp_path, 1000)
    print(f"\npeak RSS rendering through map_pages (window 4): "
          f"100 pages {small:.1f} MB, 1000 pages {large:.1f} MB")
    assert large <= small + 25, (small, large)
