"""The app's HTTP API from the client side, standard library only (the client installs light).

A request either returns the parsed 200 body or raises one of:
  - `InputRejected`: the server refused this input (400/404/413/415/422, or any other 4xx):
    asking again cannot help, so it is never retried;
  - `RequestFailed`: a transient failure (408/429/5xx, a lost or refused connection, a timeout)
    persisted through every retry;
  - `AuthError` / `OptionRejected` (usage errors, exit 2): the key is refused, or the server
    rejects an option the run sends with every document, so every document would fail alike.
Retries back off exponentially with jitter; a `Retry-After` (Serve's 503 and 429 send one) is
waited out instead.
"""
from __future__ import annotations

import email.utils
import http.client
import json
import random
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field

from .errors import UsageError

RETRYABLE_STATUS = {408, 429, 500, 502, 503, 504}
AUTH_STATUS = {401, 403}
# A 400 naming one of these fields is about the run's options, sent alike with every document,
# not about the document: stop the run rather than fail every document the same way.
RUN_OPTIONS = {"prompt_preset": "--preset", "max_tokens": "--max-tokens", "dpi": "--dpi",
               "output_format": "output_format (an older app?)",
               "return_crops": "return_crops (an older app?)"}
BACKOFF_BASE_S = 1.0
BACKOFF_MAX_S = 30.0
RETRY_AFTER_MAX_S = 300.0
HEALTH_TIMEOUT_S = 10.0


class InputRejected(Exception):
    """The server refused the input itself."""

    def __init__(self, status: int, message: str):
        super().__init__(f"{message} (HTTP {status})")
        self.status = status


class RequestFailed(Exception):
    """Transient failures outlasted the retries."""


class AuthError(UsageError):
    pass


class OptionRejected(UsageError):
    pass


class _Transient(Exception):
    def __init__(self, reason: str, retry_after: float | None = None):
        super().__init__(reason)
        self.retry_after = retry_after


@dataclass
class Client:
    server: str  # http://host:port, no trailing slash
    api_key: str | None = None
    timeout_s: float | None = None
    retries: int = 5
    on_retry: Callable[[str], None] = lambda message: None
    stop: threading.Event = field(default_factory=threading.Event)  # set: no more retries

    def check_health(self) -> dict:
        """`GET /health`, once; an unreachable or unhealthy server is a usage error."""
        try:
            status, headers, body = self._send("GET", "/health", None, HEALTH_TIMEOUT_S)
        except (OSError, http.client.HTTPException) as e:
            raise UsageError(f"server {self.server} is unreachable: {_reason(e)}") from None
        if status in AUTH_STATUS:
            raise AuthError(f"server {self.server} refused the API key: {_message(body)}")
        if status != 200:
            raise UsageError(f"server {self.server} is not healthy: GET /health answered "
                             f"{status}: {_message(body)}")
        return _json_or_empty(body)

    def ocr(self, body: dict, label: str = "") -> dict:
        """`POST /v1/ocr` with retries; `label` names the document in retry messages."""
        payload = json.dumps(body).encode()
        for attempt in range(self.retries + 1):
            try:
                return self._ocr_once(payload)
            except _Transient as e:
                if attempt == self.retries or self.stop.is_set():
                    raise RequestFailed(f"{e} (gave up after {attempt + 1} attempts)") from None
                delay = e.retry_after if e.retry_after is not None else backoff_s(attempt)
                self.on_retry(f"{label}: {e}; retry {attempt + 1}/{self.retries} in {delay:.1f} s")
                if self.stop.wait(delay):
                    raise RequestFailed(f"{e} (the run stopped)") from None
        raise AssertionError("unreachable")

    def _ocr_once(self, payload: bytes) -> dict:
        try:
            status, headers, body = self._send("POST", "/v1/ocr", payload, self.timeout_s)
        except (OSError, http.client.HTTPException) as e:  # refused, reset, timed out
            raise _Transient(f"connection failed: {_reason(e)}") from None
        if status == 200:
            try:
                return json.loads(body)
            except ValueError:  # a body cut off in transit
                raise _Transient("the 200 response is not valid JSON") from None
        message = _message(body)
        if status in RETRYABLE_STATUS:
            raise _Transient(f"HTTP {status}: {message}", retry_after(headers.get("Retry-After")))
        if status in AUTH_STATUS:
            raise AuthError(f"server {self.server} refused the API key (HTTP {status}): {message}")
        param = _error_field(body, "param")
        if status in (400, 422) and param in RUN_OPTIONS:
            raise OptionRejected(f"the server rejects {RUN_OPTIONS[param]}: {message}")
        raise InputRejected(status, message)

    def _send(self, method: str, path: str, payload: bytes | None,
              timeout_s: float | None) -> tuple[int, http.client.HTTPMessage, bytes]:
        headers = {"Accept": "application/json"}
        if payload is not None:
            headers["Content-Type"] = "application/json"
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(self.server + path, data=payload, headers=headers,
                                         method=method)
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                return response.status, response.headers, response.read()
        except urllib.error.HTTPError as e:  # a status other than 2xx: read its error body
            with e:
                return e.code, e.headers, e.read()


def backoff_s(attempt: int) -> float:
    """Exponential, capped, with jitter (half fixed, half random) so that workers that failed
    together do not all come back together."""
    delay = min(BACKOFF_MAX_S, BACKOFF_BASE_S * 2 ** attempt)
    return delay / 2 + random.uniform(0, delay / 2)


def retry_after(value: str | None) -> float | None:
    """A `Retry-After` header in seconds (delta-seconds or an HTTP date), capped."""
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            seconds = email.utils.parsedate_to_datetime(value).timestamp() - time.time()
        except (TypeError, ValueError):
            return None
    return min(max(seconds, 0.0), RETRY_AFTER_MAX_S)


def _message(body: bytes) -> str:
    """The error envelope's message, else the start of the body (Serve's proxy answers its 503
    and 408 in plain text)."""
    message = _error_field(body, "message")
    if isinstance(message, str) and message:
        return message
    text = body.decode("utf-8", "replace").strip()
    return text[:300] or "no message"


def _error_field(body: bytes, name: str):
    error = _json_or_empty(body).get("error")
    return error.get(name) if isinstance(error, dict) else None


def _json_or_empty(body: bytes) -> dict:
    try:
        value = json.loads(body)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _reason(error: BaseException) -> str:
    if isinstance(error, urllib.error.URLError) and not isinstance(error, urllib.error.HTTPError):
        error = error.reason if isinstance(error.reason, BaseException) else error
    if isinstance(error, (socket.timeout, TimeoutError)):
        return "timed out"
    return str(error) or type(error).__name__

