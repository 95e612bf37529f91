"""What stops a run before or while it works (exit code 2), as opposed to one document failing."""
from __future__ import annotations


class UsageError(Exception):
    """Bad arguments, no inputs, an unreachable server, a refused API key: exit 2."""
