"""What several test files check the same way (not a test file)."""
from __future__ import annotations

# What Ray's wrapper of a replica's exception carries, and what a client must never see.
LEAKS = ("ray::", "pid=", "ip=", "actor_id", "\x1b[", "Traceback", "ServeReplica")


def assert_clean_error(response, status: int, words: str, param: str | None) -> dict:
    """`response` is the one error envelope with `status`, naming `param`, its message holding
    `words` and none of Ray's internals; returns the error."""
    assert response.status_code == status, (response.status_code, response.text[:500])
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["param"] == param, error
    assert words in error["message"], error
    assert not any(leak in response.text for leak in LEAKS), response.text[:2000]
    return error
