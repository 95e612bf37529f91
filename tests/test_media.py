"""Chat image URLs within the operator's rules, and figure crops (deployments/media.py; no Ray)."""
import asyncio
import base64
import datetime
import functools
import http.server
import io
import ipaddress
import socket
import ssl
import threading
import urllib.parse
from pathlib import Path

import pytest
from PIL import Image

from decoder.grounding import parse_blocks
from deployments import media
from deployments.media import crop_image_blocks, read_image_url
from deployments.protocol import BadRequest, PayloadTooLarge
from tests.helpers import png



class Handler(http.server.SimpleHTTPRequestHandler):
    """Files, plus `/hops/N` (N redirects, relative, through every redirect status, then
    small.png), `/to?<URL>` (a 302 to that URL) and `/unsized/<file>` (the file without a
    Content-Length); it records each request's Host header."""

    hosts: list = []

    def do_GET(self):
        type(self).hosts.append(self.headers["Host"])
        path, _, query = self.path.partition("?")
        if path.startswith("/hops/"):
            left = int(path.rsplit("/", 1)[1])
            status = (301, 302, 303, 307, 308)[left % 5]
            return self.redirect(status, f"/hops/{left - 1}" if left > 1 else "/small.png")
        if path == "/to":
            return self.redirect(302, urllib.parse.unquote(query))
        if path.startswith("/unsized/"):  # HTTP/1.0: the body ends where the connection does
            data = (Path(self.directory) / path.rsplit("/", 1)[1]).read_bytes()
            self.send_response(200)
            self.end_headers()
            return self.wfile.write(data)
        return super().do_GET()

    def redirect(self, status, location):
        self.send_response(status)
        self.send_header("Location", location)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


def serve(root, wrap=None):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=str(root)))
    if wrap is not None:
        server.socket = wrap(server.socket)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture(scope="module")
def http_root(tmp_path_factory):
    """A loopback HTTP server over a folder holding small.png and big.png."""
    root = tmp_path_factory.mktemp("www")
    (root / "small.png").write_bytes(png())
    (root / "big.png").write_bytes(png((2000, 2000)) + b"\0" * 200_000)
    server = serve(root)
    yield root, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def read(url, fetch=False, local_root=None, max_bytes=100_000, timeout_s=5.0, **rules):
    return asyncio.run(read_image_url(url, max_bytes, fetch, timeout_s, local_root, **rules))


def refused(url, **rules) -> BadRequest:
    """The error of fetching `url` (fetch_image_urls on)."""
    with pytest.raises(BadRequest) as error:
        read(url, fetch=True, **rules)
    return error.value


@pytest.fixture
def connections(monkeypatch):
    """The addresses the process connects to (from here on): every TCP connection goes through
    socket.socket.connect, whatever opens it."""
    made = []
    real = socket.socket.connect

    def connect(sock, address):
        made.append(address[:2])
        return real(sock, address)
    monkeypatch.setattr(socket.socket, "connect", connect)
    return made


@pytest.fixture
def names(monkeypatch):
    """Made-up host names resolving to chosen addresses (others resolve as usual); the names
    asked for are recorded, in order."""
    table, asked = {}, []
    real = socket.getaddrinfo

    def getaddrinfo(host, port, *args, **kwargs):
        asked.append(host)
        if host in table:
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (table[host], port))]
        return real(host, port, *args, **kwargs)
    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    return table, asked


@pytest.fixture
def loopback_is_public(monkeypatch):
    """127.0.0.1 (the test servers) counts as a public address; every other address is checked
    as it is: so that a fetch may start at a test server while its redirects are checked."""
    real = media._is_public
    monkeypatch.setattr(media, "_is_public", lambda a: a == ipaddress.ip_address("127.0.0.1") or real(a))


def test_data_urls_are_always_read():
    data = png()
    assert read("data:image/png;base64," + base64.b64encode(data).decode()) == data
    with pytest.raises(BadRequest, match="data: URL"):
        read("data:text/html;base64,AAAA")


def test_http_urls_only_when_fetching_is_on(http_root):
    root, url = http_root
    with pytest.raises(BadRequest, match="fetch_image_urls"):
        read(f"{url}/small.png")
    assert read(f"{url}/small.png", fetch=True, allow_private=True) == (root / "small.png").read_bytes()
    with pytest.raises(PayloadTooLarge):
        read(f"{url}/big.png", fetch=True, allow_private=True)
    with pytest.raises(PayloadTooLarge):  # also when no Content-Length says so before the body
        read(f"{url}/unsized/big.png", fetch=True, allow_private=True)
    assert read(f"{url}/unsized/small.png", fetch=True, allow_private=True) == png()


def test_a_loopback_url_is_refused_unless_private_addresses_are_allowed(http_root, connections):
    root, url = http_root
    error = refused(f"{url}/small.png")
    assert (str(error), error.param) == ("could not fetch the image URL", "image_url")
    assert connections == []
    assert read(f"{url}/small.png", fetch=True, allow_private=True) == (root / "small.png").read_bytes()
    assert connections == [("127.0.0.1", int(url.rsplit(":", 1)[1]))]


@pytest.mark.parametrize("host", ["localhost", "169.254.169.254", "10.0.0.1", "[::1]",
                                  "[::ffff:127.0.0.1]", "[::ffff:169.254.169.254]", "0.0.0.0",
                                  "100.64.0.1", "[fe80::1]", "224.0.0.1", "2130706433",
                                  "[2002:7f00:1::]", "[64:ff9b::a9fe:a9fe]"])
def test_internal_addresses_are_refused_before_connecting(host, connections):
    error = refused(f"http://{host}/latest/meta-data/")
    assert (str(error), error.param) == ("could not fetch the image URL", "image_url")
    assert connections == []


def test_every_address_of_a_name_must_be_public(monkeypatch, connections):
    """A name resolving to a public and a private address is refused: the connection could go to
    either."""
    monkeypatch.setattr(socket, "getaddrinfo", lambda host, port, *a, **k: [
        (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("93.184.215.14", port)),
        (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.1.2.3", port))])
    assert str(refused("http://mixed.example.test/a.png")) == "could not fetch the image URL"
    assert connections == []


def test_the_connection_goes_to_the_address_checked(http_root, names, connections, loopback_is_public):
    """The name is resolved once per hop, the connection made to that address, and the server
    is asked for the URL's host name (its Host header), through redirects too."""
    root, url = http_root
    port = int(url.rsplit(":", 1)[1])
    table, asked = names
    table["images.example.test"] = "127.0.0.1"
    Handler.hosts.clear()
    got = read(f"http://Images.Example.Test.:{port}/hops/2", fetch=True)
    assert got == (root / "small.png").read_bytes()
    assert asked == ["images.example.test"] * 3
    assert connections == [("127.0.0.1", port)] * 3
    assert Handler.hosts == [f"images.example.test:{port}"] * 3


def test_redirects_are_checked_again(http_root, names, connections, loopback_is_public):
    """A fetch that starts at an allowed host is refused where it is redirected to an internal
    address, and not followed there."""
    root, url = http_root
    port = int(url.rsplit(":", 1)[1])
    names[0].update({"images.example.test": "127.0.0.1",
                     "metadata.google.internal.example.test": "169.254.169.254"})
    start = f"http://images.example.test:{port}/to?"
    assert read(start + f"http://images.example.test:{port}/small.png", fetch=True) == png()  # the control
    connections.clear()
    for target in ("http://169.254.169.254/latest/meta-data/", "http://10.0.0.1/a.png",
                   "http://[::1]/a.png", "http://metadata.google.internal.example.test/"):
        error = refused(start + urllib.parse.quote(target))
        assert (str(error), error.param) == ("could not fetch the image URL", "image_url"), target
        assert connections == [("127.0.0.1", port)], target  # the first hop only
        connections.clear()


def test_at_most_three_redirects(http_root):
    root, url = http_root
    assert read(f"{url}/hops/3", fetch=True, allow_private=True) == (root / "small.png").read_bytes()
    assert str(refused(f"{url}/hops/4", allow_private=True)) == "could not fetch the image URL"


def test_redirects_only_to_http_urls(http_root):
    root, url = http_root
    assert read(f"{url}/to?/small.png", fetch=True, allow_private=True) == png()  # the control
    port = url.rsplit(":", 1)[1]  # ftp: and gopher: at the HTTP server's port would read it
    for target in (f"file://{root}/small.png", f"ftp://127.0.0.1:{port}/small.png",
                   f"gopher://127.0.0.1:{port}/small.png", "data:image/png;base64,AAAA"):
        error = refused(f"{url}/to?{urllib.parse.quote(target)}", allow_private=True,
                        local_root=str(root))  # not even where file:// URLs are read
        assert str(error) == "could not fetch the image URL", target


def test_allowed_domains(http_root, names, connections):
    root, url = http_root
    port = int(url.rsplit(":", 1)[1])
    table, asked = names
    table["img.example.com"] = table["evil.com"] = "127.0.0.1"
    rules = {"allowed_domains": ("Example.COM.",), "allow_private": True}
    for outside in ("http://evil.com/x.png", "http://notexample.com/x.png",
                    "http://example.com.evil.com/x.png", f"http://127.0.0.1:{port}/small.png"):
        error = refused(outside, **rules)
        assert (str(error), error.param) == ("image URL host is not in allowed_media_domains", "image_url")
    assert asked == [] and connections == []  # refused before any name resolution
    for inside in (f"http://img.example.com:{port}/small.png", f"http://IMG.example.com.:{port}/small.png"):
        assert read(inside, fetch=True, **rules) == png()
    # a redirect off the list: the one message of a failed fetch, not the list's
    error = refused(f"http://img.example.com:{port}/to?http://evil.com:{port}/small.png", **rules)
    assert str(error) == "could not fetch the image URL"
    assert "evil.com" not in asked


def test_one_message_for_every_failed_fetch(http_root):
    """A closed port, an HTTP 404, a refused address and an unknown name read the same, so that
    a client cannot tell which hosts and ports answer."""
    root, url = http_root
    with socket.socket() as s:  # a port that was free a moment ago, now closed
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    errors = [refused(f"http://127.0.0.1:{closed}/a.png", allow_private=True),
              refused(f"{url}/missing.png", allow_private=True),
              refused(f"{url}/small.png"),
              refused("http://no-such-host.invalid/a.png")]
    assert {str(e) for e in errors} == {"could not fetch the image URL"}
    assert {e.param for e in errors} == {"image_url"}
    assert not any(isinstance(e, PayloadTooLarge) for e in errors)


def test_the_time_limit_covers_a_slow_server(connections):
    """A server that accepts and never answers: refused within the time limit, the one message."""
    import time
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        start = time.monotonic()
        error = refused(f"http://127.0.0.1:{listener.getsockname()[1]}/a.png", allow_private=True,
                        timeout_s=0.3)
        assert time.monotonic() - start < 2
    assert str(error) == "could not fetch the image URL" and len(connections) == 1


def test_https_checks_the_certificate_against_the_urls_host(tmp_path, names, monkeypatch):
    """TLS to the checked address still names the URL's host: a certificate for that name is
    accepted, one for another name is not."""
    x509 = pytest.importorskip("cryptography.x509")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(x509.oid.NameOID.COMMON_NAME, "test CA")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(1).not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("secure.example.test")]), False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
            .sign(key, hashes.SHA256()))
    (tmp_path / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (tmp_path / "key.pem").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    (tmp_path / "small.png").write_bytes(png())
    server_context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_context.load_cert_chain(tmp_path / "cert.pem", tmp_path / "key.pem")
    server = serve(tmp_path, lambda sock: server_context.wrap_socket(sock, server_side=True))
    port = server.server_address[1]
    monkeypatch.setattr(media, "_tls_context", lambda: ssl.create_default_context(cafile=tmp_path / "cert.pem"))
    names[0].update({"secure.example.test": "127.0.0.1", "other.example.test": "127.0.0.1"})
    try:
        assert read(f"https://secure.example.test:{port}/small.png", fetch=True, allow_private=True) == png()
        error = refused(f"https://other.example.test:{port}/small.png", allow_private=True)
        assert str(error) == "could not fetch the image URL"
    finally:
        server.shutdown()


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
