"""Replica logs that say whose fault a failure is. Serve logs every exception a replica's method
raises as "Request failed." at ERROR with its traceback; a caller's bad image or option is not
the replica's failure, and a truncated page would log a traceback on the Router and on each
encoder replica it reached. `ClientErrorsInOneLine` turns those records into one WARNING line
(Serve's own line: replica, request id) naming the problem; real failures keep their tracebacks.
"""
from __future__ import annotations

import logging

from .protocol import CLIENT_ERRORS, replica_error

SERVE_LOGGER = "ray.serve"


class ClientErrorsInOneLine(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        error = replica_error(record.exc_info[1]) if record.exc_info else None
        if isinstance(error, CLIENT_ERRORS):
            record.msg = "Request refused, the caller's to fix: %s: %s"
            record.args = (type(error).__name__, error)
            record.levelno, record.levelname = logging.WARNING, "WARNING"
            record.exc_info = record.exc_text = None
        return True


def log_client_errors_in_one_line() -> None:
    """In this replica's process (idempotent: one filter however often it is called)."""
    logger = logging.getLogger(SERVE_LOGGER)
    if not any(isinstance(f, ClientErrorsInOneLine) for f in logger.filters):
        logger.addFilter(ClientErrorsInOneLine())
