"""Batch jobs' store and worker (deployments/batch_store.py, batch_runner.py) in plain Python,
on SQLite, over an `answer` that stands for the app's request path: bad lines fail alone, a
worker stopped midway is taken over once its lease runs out and the output holds every line
once, equal to an uninterrupted run's; one worker at a time; cancel and expiry; OpenAI's types."""
import asyncio
import json

import openai.types
import pytest

from deployments.batch_runner import BatchRunner
from deployments.batch_store import BatchStore, FileStorage

ENDPOINT = "/v1/ocr"


def line(custom_id, body=None, url=ENDPOINT, **extra) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body or {"n": custom_id}, **extra})


INPUT = "\n".join([*(line(f"r{i}") for i in range(12)), "{not json", line("r3"), line("bad-url", url="/v1/x"),
                   line("refused", {"refuse": True}), "", line("last")]) + "\n"


class App:
    """The request path: 200 echoing the body, 400 for `refuse`; `hold` blocks answers until set."""

    def __init__(self):
        self.answered: list[str] = []
        self.hold: asyncio.Event | None = None

    async def __call__(self, endpoint: str, body: dict):
        assert endpoint == ENDPOINT
        if self.hold is not None:
            await self.hold.wait()
        await asyncio.sleep(0.01)
        if body.get("refuse"):
            return 400, {"error": {"message": "refused", "type": "invalid_request", "param": None, "code": None}}
        self.answered.append(body["n"])
        return 200, {"text": f"page {body['n']}"}


@pytest.fixture(scope="module")
def postgres(tmp_path_factory):
    """A PostgreSQL server from PyPI (pgserver), on a Unix socket in a folder of its own; a
    fresh database per test."""
    pgserver = pytest.importorskip("pgserver")
    server = pgserver.get_server(str(tmp_path_factory.mktemp("pg")), cleanup_mode="stop")
    yield server
    server.cleanup()


@pytest.fixture(params=["sqlite", "postgresql"])
def store(request, tmp_path):
    """The store on SQLite and on PostgreSQL: the same tests on both."""
    location = str(tmp_path / "batches.db")
    if request.param == "postgresql":
        server = request.getfixturevalue("postgres")
        database = f"test_{tmp_path.name.replace('-', '_').lower()}"
        server.psql(f"CREATE DATABASE {database};")
        location = server.get_uri(database)
    store = BatchStore(location, FileStorage(str(tmp_path / "files")))
    yield store
    store.close()


def submit(store: BatchStore, text: str = INPUT, window_s: int = 86400) -> dict:
    upload = store.create_file("batch", "in.jsonl", text.encode())
    return store.create_batch(upload["id"], ENDPOINT, window_s, "24h", {"who": "test"})


def read(store: BatchStore, file_id: str | None) -> dict[str, dict]:
    if file_id is None:
        return {}
    rows = [json.loads(row) for row in store.file_content(file_id).decode().splitlines()]
    assert len({row["custom_id"] for row in rows}) == len(rows) or any(r["custom_id"] is None for r in rows)
    return {row["custom_id"]: row for row in rows}


def strip(rows: dict) -> dict:
    """Rows without their fresh ids (`id`, `request_id`)."""
    out = {}
    for key, row in rows.items():
        response = row["response"] and {k: v for k, v in row["response"].items() if k != "request_id"}
        out[key] = {"response": response, "error": row["error"]}
    return out


def test_a_batch_runs_to_completion_and_bad_lines_fail_alone(store):
    batch = submit(store)
    openai.types.Batch.model_validate(batch)
    assert batch["status"] == "validating" and batch["metadata"] == {"who": "test"}
    app = App()
    assert asyncio.run(BatchRunner(store, app, concurrency=4).run_once())
    done = store.get_batch(batch["id"])
    openai.types.Batch.model_validate(done)
    assert done["status"] == "completed" and done["completed_at"] and done["in_progress_at"]
    assert done["request_counts"] == {"total": 17, "completed": 13, "failed": 4}
    output, errors = read(store, done["output_file_id"]), read(store, done["error_file_id"])
    assert set(output) == {f"r{i}" for i in range(12)} | {"last"}
    assert output["r5"]["response"]["status_code"] == 200 and output["r5"]["response"]["body"] == {"text": "page r5"}
    assert errors["refused"]["response"]["status_code"] == 400 and errors["refused"]["error"]["code"] == "invalid_request"
    assert "earlier line" in errors["r3"]["error"]["message"] and "endpoint" in errors["bad-url"]["error"]["message"]
    assert errors[None]["response"] is None and "not JSON" in errors[None]["error"]["message"]
    assert sorted(app.answered) == sorted(output)  # each good line answered once
    openai.types.FileObject.model_validate(store.get_file(done["output_file_id"]))


def test_a_worker_stopped_midway_is_taken_over_and_every_line_is_answered_once(store, tmp_path):
    batch = submit(store)

    async def stopped_midway():
        app = App()
        first = BatchRunner(store, app, owner="first", lease_s=1.0, concurrency=2)
        run = asyncio.create_task(first.run_once())
        while len(store.done_lines(batch["id"])) < 6:
            await asyncio.sleep(0.01)
        given_back, store.release = store.release, lambda *_: None  # a replica killed gives nothing back:
        run.cancel()  # its lease is left to run out
        await asyncio.gather(run, return_exceptions=True)
        store.release = given_back
        assert await BatchRunner(store, App(), owner="second", lease_s=1.0).run_once() is False  # still leased
        await asyncio.sleep(1.1)
        second_app = App()
        assert await BatchRunner(store, second_app, owner="second", lease_s=1.0).run_once()
        return app.answered, second_app.answered
    first_answered, second_answered = asyncio.run(stopped_midway())
    assert not set(first_answered) & set(second_answered)  # nothing answered twice
    resumed = store.get_batch(batch["id"])
    assert resumed["status"] == "completed" and resumed["request_counts"]["completed"] == 13

    other = BatchStore(str(tmp_path / "other.db"), FileStorage(str(tmp_path / "other-files")))  # SQLite either way
    whole = submit(other)
    asyncio.run(BatchRunner(other, App()).run_once())
    whole = other.get_batch(whole["id"])
    assert strip(read(store, resumed["output_file_id"])) == strip(read(other, whole["output_file_id"]))
    assert strip(read(store, resumed["error_file_id"])) == strip(read(other, whole["error_file_id"]))


def test_one_worker_holds_a_batch_and_a_lost_lease_stops_the_other(store):
    batch = submit(store)
    assert store.claim("a", 30)["id"] == batch["id"]
    assert store.claim("b", 30) is None
    assert not store.renew(batch["id"], "b", 30) and store.renew(batch["id"], "a", 30)
    assert not store.set_status(batch["id"], "b", "in_progress")


def test_cancel_mid_run_ends_cancelled_with_the_answers_so_far(store):
    batch = submit(store)

    async def cancelled():
        app = App()
        run = asyncio.create_task(BatchRunner(store, app, lease_s=0.3, concurrency=1).run_once())
        while len(store.done_lines(batch["id"])) < 3:
            await asyncio.sleep(0.01)
        assert store.cancel(batch["id"])["status"] == "cancelling"
        await run
    asyncio.run(cancelled())
    done = store.get_batch(batch["id"])
    assert done["status"] == "cancelled" and done["cancelled_at"] and done["cancelling_at"]
    assert 3 <= done["request_counts"]["completed"] < 13 and done["output_file_id"]


def test_a_batch_past_its_window_expires_and_a_file_that_is_not_jsonl_fails_it(store):
    expired = submit(store, window_s=-1)
    failed = submit(store, text="\n\n")
    runner = BatchRunner(store, App())
    assert asyncio.run(runner.run_once()) and asyncio.run(runner.run_once())
    assert store.get_batch(expired["id"])["status"] == "expired"
    failed = store.get_batch(failed["id"])
    assert failed["status"] == "failed" and failed["errors"]["data"][0]["code"] == "invalid_input_file"
    openai.types.Batch.model_validate(failed)


def test_batches_list_newest_first_in_pages(store):
    made = [submit(store, line("x") + "\n")["id"] for _ in range(5)]
    first, more = store.list_batches(limit=2)
    rest, more_after = store.list_batches(after=first[-1]["id"], limit=10)
    assert more and not more_after
    assert [b["id"] for b in first + rest] == made[::-1]  # made within one second: still in order


class Counter:
    def __init__(self):
        self.counts: dict = {}

    def inc(self, tags):
        key = tuple(sorted(tags.items()))
        self.counts[key] = self.counts.get(key, 0) + 1


def test_a_line_the_full_app_refuses_is_sent_again_and_counted_once(store, monkeypatch):
    """A batch line refused as the app is full (503, 429: its class waits below interactive
    work and may find the decoder's batch queue full) is not a failed line: it is sent again
    after a pause until taken; the lines and the batch are counted in the metrics."""
    from deployments import batch_runner
    monkeypatch.setattr(batch_runner, "RETRY_FIRST_S", 0.01)
    batch = submit(store, line("a") + "\n" + line("b") + "\n")
    app, refusals = App(), {"a": 2, "b": 1}

    async def full_at_first(endpoint, body):
        if refusals[body["n"]]:
            refusals[body["n"]] -= 1
            return (503 if body["n"] == "a" else 429), {"error": {"message": "full", "type": "overloaded"}}
        return await app(endpoint, body)
    metrics = {"batch_lines": Counter(), "batch_batches": Counter()}
    asyncio.run(BatchRunner(store, full_at_first, metrics=metrics).run_once())
    done = store.get_batch(batch["id"])
    assert done["status"] == "completed" and done["request_counts"] == {"total": 2, "completed": 2, "failed": 0}
    assert sorted(app.answered) == ["a", "b"] and refusals == {"a": 0, "b": 0}
    assert metrics["batch_lines"].counts == {(("outcome", "ok"),): 2}
    assert metrics["batch_batches"].counts == {(("status", "completed"),): 1}


def test_a_cancel_ends_the_lines_held_in_the_app(store):
    """Lines held in the app (below interactive work that never lets up) do not keep a
    cancelled batch waiting: their calls are cancelled and the batch ends cancelled, those
    lines unanswered."""
    batch = submit(store)

    async def cancelled():
        app = App()
        app.hold = asyncio.Event()  # never set: every line waits in the app
        run = asyncio.create_task(BatchRunner(store, app, lease_s=0.3, concurrency=4).run_once())
        while store.get_batch(batch["id"])["status"] != "in_progress":
            await asyncio.sleep(0.01)
        store.cancel(batch["id"])
        await asyncio.wait_for(run, timeout=30)
    asyncio.run(cancelled())
    done = store.get_batch(batch["id"])
    assert done["status"] == "cancelled" and done["request_counts"]["completed"] == 0


def test_lines_wait_for_their_turn_before_going_into_the_app(store):
    """The Router's turn (no interactive request in flight for a moment) is awaited before each
    line is sent: none goes in while it is withheld, all do once it is given."""
    batch = submit(store, "".join(line(f"t{i}") + "\n" for i in range(5)))

    async def scenario():
        app, given = App(), asyncio.Event()

        async def turn():
            await given.wait()
        run = asyncio.create_task(BatchRunner(store, app, concurrency=2, turn=turn).run_once())
        await asyncio.sleep(0.3)
        assert app.answered == [] and store.get_batch(batch["id"])["status"] == "in_progress"
        given.set()
        await run
        return app.answered
    assert sorted(asyncio.run(scenario())) == [f"t{i}" for i in range(5)]
    assert store.get_batch(batch["id"])["status"] == "completed"


def test_a_worker_stopped_gives_its_batch_back_at_once(store):
    """A worker cancelled mid-batch (its replica shutting down) releases the batch: another
    claims it at once, not after the lease (60 s here), and finishes it from the recorded lines."""
    batch = submit(store, "".join(line(f"s{i}") + "\n" for i in range(6)))

    async def stopped():
        app = App()
        run = asyncio.create_task(BatchRunner(store, app, lease_s=60, concurrency=1).run_once())
        while len(store.done_lines(batch["id"])) < 2:
            await asyncio.sleep(0.01)
        run.cancel()
        await asyncio.gather(run, return_exceptions=True)
        assert store.get_batch(batch["id"])["status"] == "in_progress"
        assert await BatchRunner(store, App()).run_once()  # claimed at once
    asyncio.run(stopped())
    done = store.get_batch(batch["id"])
    assert done["status"] == "completed" and done["request_counts"]["completed"] == 6
