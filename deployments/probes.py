"""Liveness and readiness probes answered within a second while the app starts.

Serve's proxy opens the HTTP port before the app's Router replica exists: it answers 404 until
the app's route is registered, then holds any request for it until a Router replica is up
(seconds: a fresh worker process imports torch and the app while the other tiers start beside
it). A probe must not wait that long, so this middleware, run inside the proxy (Serve's
`RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`, in the app's STARTUP_ENVIRONMENT), passes
`GET .../health` and `.../ready` on to the Router and, when no Router answers within
ANSWER_WITHIN_S (or the route is not registered yet), answers them itself: 503, `Retry-After`,
in the app's error envelope. Once a Router has answered a probe path, the middleware steps aside
for it: a busy Router later is the Router's to answer, not a start-up. Every other request
passes untouched.

Plain ASGI, importing nothing of the app: the proxy process loads no torch for it.
"""
import asyncio
import json

from starlette.middleware import Middleware

PROBES = ("/health", "/ready")
# A probe's answer, the Router's or this one, comes within a second; a running Router answers in
# milliseconds.
ANSWER_WITHIN_S = 0.5
RETRY_AFTER_S = 1


class StartupProbes:
    """ASGI middleware: a probe the Router does not answer in time is answered 503 here."""

    def __init__(self, app, answer_within_s: float = ANSWER_WITHIN_S):
        self.app = app
        self.answer_within_s = answer_within_s
        self.answered: set[str] = set()  # probe paths a Router has answered: started
        # Per probe path, the call still held in the proxy. It is left to finish, not cancelled:
        # a cancelled call makes Serve's proxy log a disconnect and an unretrieved
        # RequestCancelledError traceback for every probe of a start-up. One call a path at a
        # time: while it is held, later probes are answered at once.
        self.held: dict[str, asyncio.Future] = {}

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        if (scope["type"] != "http" or scope["method"] != "GET"
                or not path.rstrip("/").endswith(PROBES) or path in self.answered):
            return await self.app(scope, receive, send)
        if path in self.held:
            return await _unavailable(send, "no Router replica has answered yet: the app is starting")
        messages = []

        async def keep(message):
            messages.append(message)

        call = asyncio.ensure_future(self.app(scope, _request_then_wait(), keep))
        finished, _ = await asyncio.wait([call], timeout=self.answer_within_s)
        if not finished:  # the route is held: no Router replica is up yet
            self.held[path] = call
            call.add_done_callback(lambda done: self._settled(path, done, messages))
            return await _unavailable(send, f"no Router replica answered within "
                                            f"{self.answer_within_s:g} s: the app is starting")
        call.result()
        if _not_routed(messages):  # Serve's own 404: the app's route is not registered yet
            return await _unavailable(send, "the app is starting: its route is not registered yet")
        self.answered.add(path)
        for message in messages:
            await send(message)

    def _settled(self, path: str, call: asyncio.Future, messages: list) -> None:
        """A held call ended (a Router came up, or the proxy gave up on it): the next probe of
        its path goes through again, or, a Router having answered, passes untouched."""
        del self.held[path]
        if not call.cancelled() and call.exception() is None and messages and not _not_routed(messages):
            self.answered.add(path)


def _request_then_wait():
    """`receive` for a held probe call: its empty GET body, then nothing (never a disconnect:
    the client's connection has its answer already and may close)."""
    sent = False

    async def receive():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": b"", "more_body": False}
        await asyncio.Event().wait()
    return receive


def _not_routed(messages: list) -> bool:
    """The proxy's plain-text 404 for a path no application serves (the Router's are JSON)."""
    start = messages[0] if messages else {}
    headers = dict(start.get("headers", []))
    return start.get("status") == 404 and not headers.get(b"content-type", b"").startswith(
        b"application/json")


async def _unavailable(send, message: str) -> None:
    body = json.dumps({"status": "starting", "error": {
        "message": message, "type": "unavailable", "param": None, "code": None}}).encode()
    await send({"type": "http.response.start", "status": 503, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
        (b"retry-after", str(RETRY_AFTER_S).encode())]})
    await send({"type": "http.response.body", "body": body})


def proxy_middlewares() -> list[Middleware]:
    """What Serve's proxy calls (its HTTP callback, STARTUP_ENVIRONMENT) for the middlewares it
    wraps itself in."""
    return [Middleware(StartupProbes)]
