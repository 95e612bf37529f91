"""Images named by URL in chat requests, and crops of the figure blocks the model located.

`data:` URLs are always read. http(s) URLs are fetched only when the operator turns it on
(`fetch_image_urls`), within the request size limit and a time limit; `file://` URLs only under
the directory the operator names (`allowed_local_media_path`, vLLM's option of that name), so a
client can never make the router read arbitrary files or reach arbitrary hosts by default.

A fetched URL is a request the router makes for the client from inside the operator's network, so
(server-side request forgery):
- with `allowed_media_domains` (vLLM's option of that name) the URL's host must be one of those
  domains or a subdomain of one;
- the host name is resolved here, and the fetch is refused unless every address it resolves to is
  a public unicast one: no loopback, private, link-local (cloud metadata, 169.254.169.254), shared
  (100.64.0.0/10), multicast, reserved or unspecified address, nor an IPv6 address that embeds one
  (::ffff:127.0.0.1). `fetch_private_addresses` lifts this for operators serving images from
  their own network;
- the connection goes to the address that was checked, not to a second resolution of the name
  (which a DNS server could answer differently: rebinding); the Host header and the TLS server
  name are the URL's host name;
- redirects are followed here, at most 3, each new URL under the same rules (http(s) only);
- the whole fetch (connection, redirects, body) is within `fetch_timeout_s` and `max_request_mb`;
- every failure of a fetch (refused address, name resolution, connection, time limit, HTTP status,
  redirects) gives the client one message, so that errors cannot map the network (which hosts
  exist, which ports answer); the reason is logged for the operator.
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import http.client
import io
import ipaddress
import logging
import os
import socket
import ssl
import time
import urllib.parse
import urllib.request

from encoder.preprocess import load_image

from .protocol import BadRequest, PayloadTooLarge

log = logging.getLogger("ray.serve")

FETCH_FAILED = "could not fetch the image URL"  # the one message of every failed fetch
MAX_REDIRECTS = 3
_REDIRECTS = frozenset({301, 302, 303, 307, 308})
_SHARED_ADDRESS_SPACE = ipaddress.ip_network("100.64.0.0/10")  # carrier-grade NAT, some clouds' metadata
_NAT64 = ipaddress.ip_network("64:ff9b::/96")  # reaches the IPv4 address in its last 32 bits
_USER_AGENT = "deepseek-ocr-serve"


_DATA_URL_TYPES = {"image": ("data:image/", "data:application/octet-stream"),
                   "document": ("data:application/pdf", "data:application/octet-stream")}


def decode_data_url(value, what: str = "image", field: str | None = None) -> bytes:
    """base64 (optionally as a `data:image/...;base64,` URL, `data:application/pdf;base64,` for
    a document) -> bytes; errors name `field` (default: `what`)."""
    field = field or what
    if not isinstance(value, str):
        raise BadRequest(f"{what}s in JSON must be base64 strings, got {type(value).__name__}", field)
    if value.startswith("data:"):
        header, _, value = value.partition(",")
        if not header.startswith(_DATA_URL_TYPES[what]) or not header.endswith(";base64"):
            expected = "data:image/...;base64,..." if what == "image" else "data:application/pdf;base64,..."
            raise BadRequest(f"a data: URL {what} must be '{expected}', got {header[:60]!r}", field)
    try:  # line-wrapped base64 (what `base64` and `base64.encodebytes` write) is fine
        return base64.b64decode("".join(value.split()), validate=True)
    except (binascii.Error, ValueError):
        raise BadRequest(f"{what} is not valid base64", field) from None


async def read_image_url(url: str, max_bytes: int, fetch: bool, timeout_s: float,
                         local_root: str | None, *, allowed_domains: tuple[str, ...] | None = None,
                         allow_private: bool = False) -> bytes:
    """The bytes of a chat image part's URL, within the operator's rules (module docstring).

    `allowed_domains`: http(s) URLs' hosts must be one of these or a subdomain (None: any host);
    `allow_private`: http(s) URLs may resolve to loopback, private, link-local... addresses."""
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:  # e.g. an unclosed [IPv6 literal
        raise BadRequest(f"image_url is not a valid URL: {url[:40]!r}", "image_url") from None
    scheme = parts.scheme.lower()
    if scheme == "data":
        return decode_data_url(url)
    if scheme in ("http", "https"):
        if not fetch:
            raise BadRequest("image URLs are not fetched by this server (fetch_image_urls is off): "
                             "send the image inline as a data:image/...;base64 URL", "image_url")
        domains = None if allowed_domains is None else _normal_domains(allowed_domains)
        # The client's own URL may be told it is off the operator's list: that is the operator's
        # policy, not something learned from the network (redirects elsewhere get FETCH_FAILED).
        if domains is not None and not _host_allowed(parts.hostname, domains):
            raise BadRequest("image URL host is not in allowed_media_domains", "image_url")
        fetching = asyncio.to_thread(_fetch, url, max_bytes, timeout_s, domains, allow_private)
        try:  # the thread keeps to the time limit too, but name resolution has no time limit
            return await asyncio.wait_for(fetching, timeout_s)
        except TimeoutError:
            log.info("image URL %s not fetched: over the time limit of %s s", _for_log(url), timeout_s)
            raise BadRequest(FETCH_FAILED, "image_url") from None
    if scheme == "file":
        if local_root is None:
            raise BadRequest("file:// image URLs are not allowed by this server "
                             "(allowed_local_media_path is not set)", "image_url")
        return await asyncio.to_thread(_read_local, url, local_root, max_bytes)
    raise BadRequest(f"image_url must be a data:, http(s): or file: URL, got {url[:40]!r}", "image_url")


class _Refused(Exception):
    """A fetch this module will not make (address, domain, scheme, redirects); the message is for
    the log only."""


def _fetch(url: str, max_bytes: int, timeout_s: float, domains: frozenset[str] | None,
           allow_private: bool) -> bytes:
    deadline = time.monotonic() + timeout_s
    first = url
    try:
        for _ in range(MAX_REDIRECTS + 1):
            status, location, data = _get(url, max_bytes, deadline, domains, allow_private)
            if status in _REDIRECTS:
                if not location:
                    raise _Refused(f"HTTP {status} without a Location")
                url = urllib.parse.urljoin(url, location)  # then checked like the first URL
                continue
            if not 200 <= status < 300:
                raise _Refused(f"HTTP {status} from {_for_log(url)}")
            return data
        raise _Refused(f"more than {MAX_REDIRECTS} redirects")
    except PayloadTooLarge:  # the client's limit, not the network's state: said as it is
        raise
    except _Refused as e:
        log.warning("image URL %s not fetched: %s", _for_log(first), e)
    except (OSError, http.client.HTTPException, ValueError) as e:  # DNS, refused, time limit, TLS, bad URL
        log.info("image URL %s not fetched: %s: %s", _for_log(first), type(e).__name__, e)
    raise BadRequest(FETCH_FAILED, "image_url")


def _get(url: str, max_bytes: int, deadline: float, domains: frozenset[str] | None,
         allow_private: bool) -> tuple[int, str | None, bytes]:
    """One GET of `url` after its checks: (status, Location, body; the body only of a 2xx)."""
    parts = urllib.parse.urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https"):
        raise _Refused(f"redirected to a {scheme or 'relative'}: URL")
    host = _normal_host(parts.hostname)
    if not host:
        raise _Refused("no host in the URL")
    if domains is not None and not _host_allowed(host, domains):
        raise _Refused(f"{host} is not in allowed_media_domains")
    port = parts.port or (443 if scheme == "https" else 80)
    addresses = _resolve(host, port, allow_private)
    sock = _connect(addresses, deadline)
    response = None
    try:
        if scheme == "https":  # the certificate must name the URL's host, not the address
            sock.settimeout(_remaining(deadline))
            sock = _tls_context().wrap_socket(sock, server_hostname=host)
        connection = http.client.HTTPConnection(host, port)
        connection.sock = sock  # already connected to the checked address: it never connects itself
        target = urllib.parse.quote(parts.path or "/", safe="/%:@!$&'()*+,;=~")
        if parts.query:
            target += "?" + urllib.parse.quote(parts.query, safe="/%:@!$&'()*+,;=~?")
        connection.putrequest("GET", target, skip_host=True)
        name = f"[{host}]" if ":" in host else host
        default_port = 443 if scheme == "https" else 80
        connection.putheader("Host", name if port == default_port else f"{name}:{port}")
        connection.putheader("User-Agent", _USER_AGENT)
        connection.putheader("Connection", "close")
        sock.settimeout(_remaining(deadline))
        connection.endheaders()
        response = connection.getresponse()
        if not 200 <= response.status < 300:
            return response.status, response.getheader("Location"), b""
        if response.length is not None and response.length > max_bytes:
            raise PayloadTooLarge(f"the image at the URL is over the limit of {max_bytes} bytes", "image_url")
        chunks, size = [], 0
        while True:  # one read at a time, each within what is left of the time limit
            sock.settimeout(_remaining(deadline))
            chunk = response.read1(64 * 1024)
            if not chunk:
                return response.status, None, b"".join(chunks)
            chunks.append(chunk)
            size += len(chunk)
            if size > max_bytes:
                raise PayloadTooLarge(f"the image at the URL is over the limit of {max_bytes} bytes", "image_url")
    finally:  # the response holds the socket open until it is closed too
        if response is not None:
            response.close()
        sock.close()


def _resolve(host: str, port: int, allow_private: bool) -> list[tuple[int, tuple]]:
    """The (family, socket address) pairs of `host`, every one of them checked."""
    addresses = []
    for family, _, _, _, sockaddr in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
        if family not in (socket.AF_INET, socket.AF_INET6):
            continue
        address = ipaddress.ip_address(sockaddr[0])
        # Every address, not only the one connected to: the connection may go to any of them.
        if not allow_private and not _is_public(address):
            raise _Refused(f"{host} is or resolves to {address}, not a public address")
        addresses.append((family, sockaddr))
    if not addresses:
        raise _Refused(f"{host} resolves to no IP address")
    return addresses


def _is_public(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """A public unicast address: none of the ranges a client must not reach through the router."""
    if address.version == 6:
        # IPv6 forms that carry an IPv4 address reach that address (mapped: the local IPv4 stack;
        # 6to4 and NAT64: through a gateway), so the IPv4 address must pass too.
        embedded = address.ipv4_mapped or address.sixtofour
        if embedded is None and address in _NAT64:
            embedded = ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
        if embedded is not None and not _is_public(embedded):
            return False
    elif address in _SHARED_ADDRESS_SPACE:  # (a version check first: `in` does not make one)
        return False
    return not (address.is_loopback or address.is_private or address.is_link_local
                or address.is_multicast or address.is_reserved or address.is_unspecified
                or not address.is_global)


def _connect(addresses: list[tuple[int, tuple]], deadline: float) -> socket.socket:
    """A TCP connection to the first of the checked addresses that answers."""
    error: OSError | None = None
    for family, sockaddr in addresses:
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.settimeout(_remaining(deadline))
            sock.connect(sockaddr)
            return sock
        except OSError as e:
            sock.close()
            error = e
    raise error


def _tls_context() -> ssl.SSLContext:
    return ssl.create_default_context()


def _remaining(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("over the time limit")
    return left


def _normal_host(name: str | None) -> str:
    """A host name as DNS and the allow-list compare it: lower case, ASCII (IDNA), no final dot."""
    name = (name or "").strip().rstrip(".").lower()
    try:
        return name.encode("idna").decode("ascii") if not name.isascii() else name
    except UnicodeError:
        return ""


def _normal_domains(domains) -> frozenset[str]:
    return frozenset(d for d in (_normal_host(str(d).strip().lstrip(".")) for d in domains) if d)


def _host_allowed(host: str | None, domains: frozenset[str]) -> bool:
    host = _normal_host(host)
    if not host:
        return False
    try:  # an address literal must be listed as it is: "subdomains" of an address mean nothing
        ipaddress.ip_address(host)
        return host in domains
    except ValueError:
        return any(host == d or host.endswith("." + d) for d in domains)


def _for_log(url: str) -> str:
    """The URL without credentials or query (signed URLs carry tokens there)."""
    try:
        parts = urllib.parse.urlsplit(url)
        netloc = parts.netloc.rpartition("@")[2]
        return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, "", ""))[:200]
    except ValueError:
        return repr(url[:60])


def _read_local(url: str, local_root: str, max_bytes: int) -> bytes:
    path = os.path.realpath(urllib.request.url2pathname(urllib.parse.urlsplit(url).path))
    root = os.path.realpath(local_root)
    if os.path.commonpath([path, root]) != root:
        raise BadRequest("file:// image URLs must name a file under allowed_local_media_path", "image_url")
    if not os.path.isfile(path):
        raise BadRequest("no such image file under allowed_local_media_path", "image_url")
    if os.path.getsize(path) > max_bytes:
        raise PayloadTooLarge(f"the image file is over the limit of {max_bytes} bytes", "image_url")
    with open(path, "rb") as f:
        return f.read()


def crop_image_blocks(image, blocks: list[dict], quality: int = 90) -> None:
    """Add `crops` (base64 JPEG, one per pixel box) to each `image` block of `blocks`, cut from the
    original image as DeepSeek's scripts cut them."""
    figures = [b for b in blocks if b["label"] == "image" and b["boxes"]]
    if not figures:
        return
    picture = load_image(image)
    for block in figures:
        block["crops"] = []
        for x1, y1, x2, y2 in block["boxes"]:
            buffer = io.BytesIO()
            picture.crop((x1, y1, max(x2, x1 + 1), max(y2, y1 + 1))).save(buffer, "JPEG", quality=quality)
            block["crops"].append(base64.b64encode(buffer.getvalue()).decode())
