"""The app's Python handle, raising the app's own exceptions. A Serve handle call that fails in
the Router raises Ray's wrapper of its exception: an instance of the app's class, but whose
text is Ray's (the replica's process, address and actor, a traceback). `AppHandle` is the same
handle (`.method.remote(...)`, `.result()`, `.options(stream=True)`, iteration, `await`) whose
failures raise the exception the Router raised: `BadRequest` (`param`: the field), `ImageError`,
`DocumentError`, with their own messages, as HTTP callers get them in the error envelope.
"""
from __future__ import annotations

from .protocol import replica_error


def app_handle(app_name: str = "default") -> AppHandle:
    """The running app's handle (`serve run deployments.app:app` names it `default`, the YAML
    configs `ocr`), from any process of its cluster."""
    from ray import serve
    return AppHandle(serve.get_app_handle(app_name))


class AppHandle:
    def __init__(self, handle):
        self._handle = handle

    def options(self, **options) -> AppHandle:
        return AppHandle(self._handle.options(**options))

    def __getattr__(self, method: str) -> _Method:
        return _Method(getattr(self._handle, method))


class _Method:
    def __init__(self, method):
        self._method = method

    def remote(self, *args, **kwargs) -> _Response:
        return _Response(self._method.remote(*args, **kwargs))


class _Response:
    """A call's response (`DeploymentResponse`) or stream (`DeploymentResponseGenerator`)."""

    def __init__(self, response):
        self._response = response

    def result(self, timeout_s: float | None = None):
        try:
            return self._response.result(timeout_s=timeout_s)
        except Exception as e:
            raise replica_error(e) from None

    def __await__(self):
        try:
            return (yield from self._response.__await__())
        except Exception as e:
            raise replica_error(e) from None

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self._response)
        except StopIteration:
            raise
        except Exception as e:
            raise replica_error(e) from None

    def __aiter__(self):
        return self

    async def __anext__(self):
        try:
            return await self._response.__anext__()
        except StopAsyncIteration:
            raise
        except Exception as e:
            raise replica_error(e) from None

    def cancel(self) -> None:
        self._response.cancel()
