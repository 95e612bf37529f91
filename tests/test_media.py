"""Chat image URLs within the operator's rules, and figure crops (deployments/media.py; no Ray)."""
import asyncio
import base64
import functools
import http.server
import io
import threading

import pytest
from PIL import Image

from decoder.grounding import parse_blocks
from deployments.media import crop_image_blocks, read_image_url
from deployments.protocol import BadRequest, PayloadTooLarge


def png(size=(64, 48)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, (10, 20, 30)).save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def http_root(tmp_path_factory):
    """A loopback HTTP server over a folder holding small.png and big.png."""
    root = tmp_path_factory.mktemp("www")
    (root / "small.png").write_bytes(png())
    (root / "big.png").write_bytes(png((2000, 2000)) + b"\0" * 200_000)
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    handler.log_message = lambda *args: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield root, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def read(url, fetch=False, local_root=None, max_bytes=100_000):
    return asyncio.run(read_image_url(url, max_bytes, fetch, 5.0, local_root))


def test_data_urls_are_always_read():
    data = png()
    assert read("data:image/png;base64," + base64.b64encode(data).decode()) == data
    with pytest.raises(BadRequest, match="data: URL"):
        read("data:text/html;base64,AAAA")


def test_http_urls_only_when_fetching_is_on(http_root):
    root, url = http_root
    with pytest.raises(BadRequest, match="fetch_image_urls"):
        read(f"{url}/small.png")
    assert read(f"{url}/small.png", fetch=True) == (root / "small.png").read_bytes()
    with pytest.raises(PayloadTooLarge):
        read(f"{url}/big.png", fetch=True)
    with pytest.raises(BadRequest, match="HTTP 404"):
        read(f"{url}/missing.png", fetch=True)
    with pytest.raises(BadRequest, match="could not fetch"):
        read("http://127.0.0.1:9/refused.png", fetch=True)  # nothing listens on port 9


def test_file_urls_only_under_the_allowed_path(tmp_path):
    (tmp_path / "ok").mkdir()
    (tmp_path / "ok" / "a.png").write_bytes(png())
    (tmp_path / "secret.png").write_bytes(png())
    with pytest.raises(BadRequest, match="allowed_local_media_path"):
        read(f"file://{tmp_path}/ok/a.png")
    assert read(f"file://{tmp_path}/ok/a.png", local_root=str(tmp_path / "ok")) == png()
    for outside in (f"file://{tmp_path}/secret.png", f"file://{tmp_path}/ok/../secret.png"):
        with pytest.raises(BadRequest, match="under allowed_local_media_path"):
            read(outside, local_root=str(tmp_path / "ok"))
    with pytest.raises(BadRequest, match="URL"):
        read("ftp://example.invalid/a.png")


def test_crops_of_image_blocks_have_their_pixel_boxes_sizes():
    """A 1191 x 1684 page: each `image` box is cut from the original at its pixel box."""
    page = Image.new("RGB", (1191, 1684), (255, 255, 255))
    page.paste((200, 0, 0), (119, 539, 572, 1179))  # what the first figure box covers
    text = ("<|ref|>title<|/ref|><|det|>[[62, 45, 938, 98]]<|/det|>\n# T\n\n"
            "<|ref|>image<|/ref|><|det|>[[100, 320, 480, 700], [520, 320, 900, 700]]<|/det|>\n")
    blocks = parse_blocks(text, *page.size)
    crop_image_blocks(page, blocks)
    assert "crops" not in blocks[0]
    crops = [Image.open(io.BytesIO(base64.b64decode(c))) for c in blocks[1]["crops"]]
    assert [c.size for c in crops] == [(x2 - x1, y2 - y1) for x1, y1, x2, y2 in blocks[1]["boxes"]]
    assert blocks[1]["boxes"][0] == [119, 539, 572, 1179]  # int(v / 999 * size)
    red = crops[0].convert("RGB").getpixel((crops[0].width // 2, crops[0].height // 2))
    assert red[0] > 150 and red[1] < 60  # the red figure, not the white page
