"""Operating the app on a multi-node Ray cluster, on CPU: a rolling update under load, then
worker nodes lost under load, against the tiny model.

    python bench/cluster_operations.py                       # both (~3 min on 2 cores)
    python bench/cluster_operations.py --short --out /tmp/ops  # the test's shorter settings

Starts a private Ray cluster on this machine (bench/autoscale_timeline.py's `PrivateCluster`:
`ray.cluster_utils.Cluster`, a private RAY_TMPDIR, free ports, only its own processes ended): a
head (the Router, Serve's controller and proxy) and worker nodes added by hand, told apart by
the custom resources the GPU tiers ask for in deployments/configs/gpu-separate.yaml: two encoder
nodes (`encoder_gpu`, two places each) and three decoder nodes (`decoder_gpu`, one place each),
so a tier's replica has somewhere to go. deployments/configs/cpu-cluster.yaml pins the tiers to
them.

1. Rolling update: while clients send requests (whole answers, and `stream: true` generations
   of 1000 tokens, tens of seconds here, begun before the update), `serve deploy` of a changed
   config: a new `max_batch` (an
   app argument: every deployment's code version changes, so every replica, the Router's too,
   is replaced) and two Decoder replicas instead of one. Records when the update began and
   ended, the requests in flight when each old replica began stopping, and every request's
   outcome; then checks the app changed (`/ready`'s Decoder max_batch, the replica counts).
2. Node loss: under the same kind of load, the worker node holding an encoder replica is
   killed (every process of it SIGKILLed at once, as a machine that is lost) at a moment its
   replicas work on requests, then, once Serve has replaced what it held, one holding a Decoder
   replica. Records, from each kill, when Serve noticed (the lost replicas left RUNNING), when
   the tier was whole again (a new replica RUNNING in each lost one's place), the longest time
   without an answered request, and what became of the requests in flight.

Every request must end as 200 (a stream: its final event, `finished`, then `[DONE]`), or as a
503 / 429 with Retry-After and the JSON error envelope (the client then waits that long); a
stream whose replica was lost mid-generation, ended by the app's retryable error event and
`[DONE]`, is counted apart (interrupted); the rest is counted as failed: another status, a
stream cut or ending in another error event, no answer within REQUEST_TIMEOUT_S (hung), a broken
connection (lost). Writes cluster-operations-cpu.json (top-level `summary`) to --out
(bench/results).
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
import random
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass

import requests
import yaml

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
from bench.autoscale_timeline import APP, NODE_KINDS, PrivateCluster, deploy, percentile, write_json  # noqa: E402
from bench.workload import uniform_page  # noqa: E402
from tests.helpers import free_port  # noqa: E402

RESULTS = os.path.join(ROOT, "bench", "results")
CONFIG = os.path.join(ROOT, "deployments", "configs", "cpu-cluster.yaml")
TIERS = ("Router", "GlobalEncoder", "LocalEncoder", "Decoder")
# The worker nodes, by type: the custom resource that tells the type. Encoder nodes have two
# places (a node may hold both encoder tiers). Decoder nodes have one, like a one-GPU node: the
# update's two new Decoders land on two nodes while the old one drains on the third, so the node
# killed later holds exactly one Decoder (with two places, Ray's soft spread sometimes put both
# on one node and the kill took the whole tier) and its replacement has the third node to go to.
NODES = (("encoder", {"encoder_gpu": 2}), ("encoder", {"encoder_gpu": 2}),
         ("decoder", {"decoder_gpu": 1}), ("decoder", {"decoder_gpu": 1}), ("decoder", {"decoder_gpu": 1}))
HEAD_CPUS = 2  # the Router's (cpu-cluster.yaml), and its replacement's during an update
# The update: a new max_batch (every replica replaced) and a second Decoder replica.
UPDATE_ARGS = {"max_batch": 16}
UPDATE_REPLICAS = {"Decoder": 2}
REQUEST_TIMEOUT_S = 180  # a request with no answer after this long is hung
POLL_S = 0.25


@dataclass(frozen=True)
class Settings:
    """One scenario's load and waits."""

    plain_clients: int  # each sends whole-answer requests, one at a time
    stream_clients: int  # each sends `stream: true` requests, one at a time
    plain_tokens: int
    stream_tokens: int  # a stream's generation: ~15-100 s for 1000 tokens on 2 busy cores
    stream_rounds: int | None  # streams each stream client sends (None: until the load stops)
    warmup_s: float  # load before the update / the first kill
    after_s: float  # load after the update ended / after a lost node's tier is whole again
    wait_s: float  # at most this long for an update to end or a tier to be whole again


# The update's streams start together once the load is warm, and the update follows their first
# events: each is long enough to be in the middle of its generation when the old Decoder is told
# to stop (after its replacement runs: ~10-20 s here), so the old Decoder's graceful shutdown is
# what lets it finish. Node loss: shorter streams, all the time, and more whole answers.
FULL = {"update": Settings(plain_clients=3, stream_clients=3, plain_tokens=8, stream_tokens=1000,
                           stream_rounds=1, warmup_s=8, after_s=8, wait_s=180),
        "loss": Settings(plain_clients=5, stream_clients=2, plain_tokens=8, stream_tokens=200,
                         stream_rounds=None, warmup_s=10, after_s=20, wait_s=180)}
SHORT = {"update": Settings(plain_clients=3, stream_clients=2, plain_tokens=8, stream_tokens=1000,
                            stream_rounds=1, warmup_s=4, after_s=3, wait_s=240),
         "loss": Settings(plain_clients=4, stream_clients=1, plain_tokens=8, stream_tokens=200,
                          stream_rounds=None, warmup_s=5, after_s=8, wait_s=150)}


# --- the app's config ------------------------------------------------------------------------
def serve_config(port: int) -> dict:
    """cpu-cluster.yaml on `port`."""
    with open(CONFIG) as f:
        config = yaml.safe_load(f)
    config["http_options"]["port"] = port
    return config


def updated(config: dict, args: dict | None = None, replica_counts: dict | None = None) -> dict:
    """`config` with the update's argument values and replica counts (`UPDATE_*` by default)."""
    config = copy.deepcopy(config)
    (app,) = config["applications"]
    app["args"].update(UPDATE_ARGS if args is None else args)
    for deployment in app["deployments"]:
        count = (UPDATE_REPLICAS if replica_counts is None else replica_counts).get(deployment["name"])
        if count is not None:
            deployment["num_replicas"] = count
    return config


def targets(config: dict) -> dict[str, int]:
    return {d["name"]: d.get("num_replicas", 1) for d in config["applications"][0]["deployments"]}


def apply(config: dict) -> None:
    """`serve deploy` of `config` to the running Serve: returns at once (the update goes on)."""
    from ray.serve._private.api import serve_start
    from ray.serve.schema import ServeDeploySchema
    schema = ServeDeploySchema.model_validate(config)
    serve_start(http_options=config["http_options"], proxy_location=schema.proxy_location).deploy_apps(schema)


# --- what runs where --------------------------------------------------------------------------
def replicas() -> dict[str, list[dict]]:
    """Each tier's replicas, as Serve's controller has them: id, state, node, actor name."""
    from ray.serve.context import _get_global_client
    details = _get_global_client().get_serve_details()
    deployments = details["applications"].get(APP, {}).get("deployments", {})
    return {tier: [{"id": r["replica_id"], "state": str(r["state"]).removeprefix("ReplicaState."),
                    "node_id": r.get("node_id"), "actor_name": r.get("actor_name")}
                   for r in deployments.get(tier, {}).get("replicas", [])]
            for tier in TIERS}


def running(state: dict, tier: str, excluding: set = frozenset()) -> int:
    return sum(r["state"] == "RUNNING" and r["id"] not in excluding for r in state[tier])


def counts(state: dict) -> dict[str, dict[str, int]]:
    """Each tier's replicas by state."""
    out = {}
    for tier, replicas_ in state.items():
        out[tier] = {}
        for r in replicas_:
            out[tier][r["state"]] = out[tier].get(r["state"], 0) + 1
    return out


def ready(url: str) -> dict:
    """The app's `/ready` answer (its tiers' states), once every tier is ready."""
    deadline = time.monotonic() + 120
    while True:
        response = requests.get(f"{url}/ready", timeout=30)
        if response.status_code == 200 or time.monotonic() > deadline:
            return response.json()
        time.sleep(1)


# --- the load -------------------------------------------------------------------------------------
def request_bodies(settings: Settings, count: int = 6, seed: int = 0) -> dict[str, list[bytes]]:
    """Whole-answer and streamed request bodies: one 900 x 500 page each (gundam: a 2 x 1 grid
    of crops and the global view, so both encoder tiers work on it), every page different
    (cpu-cluster.yaml turns the encoder cache off)."""
    import base64
    rng = random.Random(seed)
    bodies = {"plain": [], "stream": []}
    for kind in bodies:
        for _ in range(count):
            image = base64.b64encode(uniform_page(rng.randrange(1 << 30), (900, 500))).decode()
            body = {"image": image, "mode": "gundam", "ngram": {"enabled": False},
                    "max_tokens": settings.stream_tokens if kind == "stream" else settings.plain_tokens}
            if kind == "stream":
                body["stream"] = True
            bodies[kind].append(json.dumps(body).encode())
    return bodies


def refusal(response: requests.Response) -> bool:
    """A retryable refusal: 503 / 429 with Retry-After and the JSON error envelope."""
    if response.status_code not in (429, 503) or not response.headers.get("Retry-After"):
        return False
    try:
        return set(response.json()["error"]) >= {"message", "type"}
    except (ValueError, KeyError, TypeError):
        return False


def read_stream(response: requests.Response, entry: dict, now) -> str:
    """The outcome of a 200 stream: ok when its last events are the final delta (`finished`)
    and `[DONE]`, with no error event; `interrupted` when the app reported in-band that its
    replica was lost (a retryable `overloaded` error, then `[DONE]`); `stream_error` for another
    error event; `cut` when it ended without `[DONE]`."""
    events = []
    for line in response.iter_lines(decode_unicode=True):
        if line.startswith("data: "):
            events.append(line.removeprefix("data: "))
            if entry.get("first_event_s") is None:
                entry["first_event_s"] = now()
    entry["events"] = len(events)
    if not events or events[-1] != "[DONE]":
        return "cut"
    try:
        payloads = [json.loads(e) for e in events[:-1]]
    except ValueError:
        return "stream_error"
    if any("error" in p for p in payloads):
        entry["error"] = next(p["error"] for p in payloads if "error" in p)
        return "interrupted" if entry["error"].get("type") == "overloaded" else "stream_error"
    return "ok" if payloads and payloads[-1].get("finished") else "cut"


class Load:
    """Client threads, each sending one request at a time until `stop()`: `plain_clients`
    whole answers, `stream_clients` streams. Every request is an entry of `log` from its start
    (`end_s` None while in flight): kind, start and end (seconds since `t0`), status, outcome."""

    def __init__(self, url: str, settings: Settings, bodies: dict[str, list[bytes]], t0: float,
                 streams_now: bool = True):
        self.url, self.bodies, self.t0, self.settings = f"{url}/v1/ocr", bodies, t0, settings
        self.log: list[dict] = []
        self._stop = threading.Event()
        self.streams = threading.Event()  # stream clients wait for it (`start_streams`)
        if streams_now:
            self.streams.set()
        kinds = ["plain"] * settings.plain_clients + ["stream"] * settings.stream_clients
        self.threads = [threading.Thread(target=self._client, args=(i, kind), daemon=True)
                        for i, kind in enumerate(kinds)]

    def __enter__(self) -> Load:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        """No new requests; waits for those in flight (each ends within REQUEST_TIMEOUT_S)."""
        self._stop.set()
        for thread in self.threads:
            thread.join(timeout=REQUEST_TIMEOUT_S + 30)

    def now(self) -> float:
        return time.monotonic() - self.t0

    def start_streams(self) -> None:
        self.streams.set()

    def in_flight(self, kind: str | None = None) -> list[dict]:
        return [e for e in list(self.log) if e["end_s"] is None and kind in (None, e["kind"])]

    def _client(self, index: int, kind: str) -> None:
        session, sent = requests.Session(), 0
        if kind == "stream":
            while not (self.streams.wait(0.2) or self._stop.is_set()):
                pass
        rounds = self.settings.stream_rounds if kind == "stream" else None
        while not self._stop.is_set() and (rounds is None or sent < rounds):
            body = self.bodies[kind][(index + sent) % len(self.bodies[kind])]
            sent += 1
            entry = {"kind": kind, "client": index, "start_s": self.now(), "end_s": None,
                     "status": None, "outcome": None}
            self.log.append(entry)  # list.append is atomic
            try:
                with session.post(self.url, data=body, headers={"content-type": "application/json"},
                                  timeout=(10, REQUEST_TIMEOUT_S), stream=kind == "stream") as response:
                    entry["status"] = response.status_code
                    if response.status_code == 200:
                        entry["outcome"] = read_stream(response, entry, self.now) if kind == "stream" else "ok"
                    elif refusal(response):
                        entry["outcome"], entry["retry_after"] = "refused", response.headers["Retry-After"]
                    else:
                        entry["outcome"] = f"error_{response.status_code}"
                        entry["error"] = response.text[:300]
            except requests.Timeout:
                entry["outcome"] = "hung"
            except requests.exceptions.ChunkedEncodingError as e:  # the stream broke off
                entry.update(outcome="cut", error=type(e).__name__)
            except requests.RequestException as e:
                entry.update(outcome="lost", error=type(e).__name__)
            except Exception as e:  # noqa: BLE001 - counted (as failed), never a dead client
                entry.update(outcome="client_error", error=repr(e)[:300])
            entry["end_s"] = self.now()
            if entry["outcome"] == "refused":
                time.sleep(float(entry["retry_after"]))  # as a client honouring Retry-After


def outcomes(log: list[dict]) -> dict:
    """Requests by outcome, whole answers and streams apart: ok (200; a stream to its end),
    refused (503 / 429 with Retry-After), interrupted (a stream ended by a retryable in-band
    error: its replica was lost), failed (the rest: another status or error event, a stream cut
    without `[DONE]`, hung, lost)."""
    out = {"total": len(log), "ok": 0, "refused": 0, "interrupted": 0, "failed": 0, "by_kind": {},
           "interrupted_or_failed": []}
    for e in log:
        kind = out["by_kind"].setdefault(e["kind"], {})
        kind[e["outcome"]] = kind.get(e["outcome"], 0) + 1
        key = e["outcome"] if e["outcome"] in ("ok", "refused", "interrupted") else "failed"
        out[key] += 1
        if key in ("failed", "interrupted"):
            out["interrupted_or_failed"].append(
                {k: e.get(k) for k in ("kind", "start_s", "end_s", "status", "outcome", "events", "error")})
    out["ok_fraction"] = round(out["ok"] / max(1, out["total"]), 4)
    plain = out["by_kind"].get("plain", {})
    out["plain_ok_fraction"] = round(plain.get("ok", 0) / max(1, sum(plain.values())), 4)
    return out


def latencies(log: list[dict]) -> dict:
    done = [(e["end_s"] - e["start_s"]) * 1e3 for e in log if e["outcome"] == "ok" and e["kind"] == "plain"]
    return {"plain_p50_ms": percentile(done, 50), "plain_p99_ms": percentile(done, 99)}


def streams_begun(load: Load, timeout_s: float = 120) -> None:
    """Once every stream client's stream in flight has sent its first event (so that what
    comes next meets streams in their middle)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        streams = load.in_flight("stream")
        if len(streams) >= load.settings.stream_clients and all(
                e.get("first_event_s") is not None for e in streams):
            return
        time.sleep(0.1)


# --- 1. the rolling update ------------------------------------------------------------------
def rolling_update(port: int, settings: Settings, config: dict | None = None,
                   new_config: dict | None = None) -> dict:
    """`config` (cpu-cluster.yaml by default) deployed and loaded, then `new_config` (the
    update by default) deployed under the load; returns the summary, the replicas' timeline and
    every request."""
    url = f"http://127.0.0.1:{port}"
    config = config or serve_config(port)
    new_config = new_config or updated(config)
    deploy(config)
    before = {"ready": ready(url), "replicas": replicas()}
    old_ids = {tier: {r["id"] for r in rs} for tier, rs in before["replicas"].items()}
    want = targets(new_config)
    t0 = time.monotonic()
    samples = []
    # Per tier, seconds from the update: its first new replica RUNNING, its (first) old replica
    # told to stop (STOPPING, or gone), its last old replica gone.
    events: dict[str, dict[str, float]] = {tier: {} for tier in TIERS}
    with Load(url, settings, request_bodies(settings), t0, streams_now=False) as load:
        time.sleep(settings.warmup_s)
        load.start_streams()
        streams_begun(load)
        update_at = load.now()
        in_flight_at_update = {k: len(load.in_flight(k)) for k in ("plain", "stream")}
        apply(new_config)
        ended_at = None
        while load.now() - update_at < settings.wait_s:
            state = replicas()
            t = round(load.now() - update_at, 2)
            samples.append({"t_s": t, "replicas": counts(state)})
            for tier in TIERS:
                if not state[tier]:  # not listed while the controller builds the new app
                    continue
                old = [r for r in state[tier] if r["id"] in old_ids[tier]]
                if any(r["id"] not in old_ids[tier] and r["state"] == "RUNNING" for r in state[tier]):
                    events[tier].setdefault("new_running_s", t)
                if len(old) < len(old_ids[tier]) or any(r["state"] != "RUNNING" for r in old):
                    events[tier].setdefault("old_stopping_s", t)
                if not old:
                    events[tier].setdefault("old_gone_s", t)
            if all(not any(r["id"] in old_ids[tier] for r in state[tier])
                   and running(state, tier) == want[tier] == len(state[tier]) for tier in TIERS):
                ended_at = load.now()
                break
            time.sleep(POLL_S)
        time.sleep(settings.after_s)
        load.stop()
    after = {"ready": ready(url), "replicas": replicas()}
    log = load.log
    # Streams generating on the old Decoder (their first event came before the update began)
    # and still in flight when it was told to stop: what its graceful shutdown let finish.
    decoder_stop = update_at + events["Decoder"].get("old_stopping_s", float("inf"))
    spanning = [e for e in log if e["kind"] == "stream" and e.get("first_event_s") is not None
                and e["first_event_s"] < update_at and (e["end_s"] or math.inf) > decoder_stop]
    router_stop = update_at + events["Router"].get("old_stopping_s", float("inf"))
    through_old_router = [e for e in log if e["start_s"] < update_at and (e["end_s"] or math.inf) > router_stop]
    summary = {
        "config": os.path.relpath(CONFIG, ROOT),
        "update": {"args": new_config["applications"][0]["args"],
                   "replicas": targets(new_config)},
        "graceful_shutdown_timeout_s": {d["name"]: d.get("graceful_shutdown_timeout_s")
                                        for d in new_config["applications"][0]["deployments"]},
        "settings": asdict(settings),
        "requests": outcomes(log), **latencies(log),
        "update_began_s": round(update_at, 2),
        "update_s": round(ended_at - update_at, 2) if ended_at is not None else None,
        "tiers": events,
        "in_flight_at_update": in_flight_at_update,
        "streams_on_the_old_decoder_when_it_stopped": {
            "total": len(spanning), "ok": sum(e["outcome"] == "ok" for e in spanning)},
        "requests_on_the_old_router_when_it_stopped": {
            "total": len(through_old_router), "ok": sum(e["outcome"] == "ok" for e in through_old_router)},
        "replicas_before": {t: running(before["replicas"], t) for t in TIERS},
        "replicas_after": {t: running(after["replicas"], t) for t in TIERS},
        "every_replica_replaced": all(not old_ids[t] & {r["id"] for r in after["replicas"][t]} for t in TIERS),
        "decoder_max_batch_before": before["ready"]["tiers"]["Decoder"].get("max_batch"),
        "decoder_max_batch_after": after["ready"]["tiers"]["Decoder"].get("max_batch"),
        "ready_after": after["ready"]["status"],
    }
    return {"summary": summary, "timeline": samples, "requests": log}


# --- 2. node loss ------------------------------------------------------------------------------------
def node_kind(node_id: str) -> str:
    import ray
    for node in ray.nodes():
        if node["NodeID"] == node_id:
            kinds = [kind for resource, kind in NODE_KINDS.items() if resource in node["Resources"]]
            return kinds[0] if kinds else "head"
    return "unknown"


def ongoing(replicas_: list[dict]) -> int:
    """Requests the replicas are working on now (Serve's own count, asked of each replica)."""
    import ray
    calls = [ray.get_actor(r["actor_name"], namespace="serve").get_num_ongoing_requests.remote()
             for r in replicas_]
    try:
        return sum(ray.get(calls, timeout=5))
    except Exception:  # noqa: BLE001 - a replica going away: counts as none
        return 0


def lose_node(cluster: PrivateCluster, load: Load, kind: str, tiers: tuple[str, ...],
              want: dict[str, int], wait_s: float, busy: int = 1, busy_within_s: float = 30) -> dict:
    """Kill a worker node of `kind` holding replicas of `tiers`: the first moment (within
    `busy_within_s`) its replicas work on `busy` requests or more, the node whose replicas then
    hold the most, so that the loss meets calls in flight; then wait until every tier it held a
    replica of is whole again. Returns what was lost and when Serve noticed and replaced it
    (seconds from the kill)."""
    state = replicas()
    nodes = {node.node_id: node for node in cluster.cluster.worker_nodes}
    held = {node_id: [(t, r) for t in tiers for r in state[t] if r["node_id"] == node_id]
            for node_id in nodes if node_kind(node_id) == kind}
    held = {node_id: on for node_id, on in held.items() if on}
    assert held, f"no {kind} node holds a replica of {tiers}: {state}"
    deadline = time.monotonic() + busy_within_s
    while True:
        working = {node_id: ongoing([r for _, r in on]) for node_id, on in held.items()}
        node_id = max(working, key=working.get)
        if working[node_id] >= busy or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    lost = held[node_id]
    lost_ids = {r["id"] for _, r in lost}
    lost_tiers = sorted({t for t, _ in lost})
    killed_at = load.now()
    cluster.kill_node(nodes[node_id])
    killed_in_s = load.now() - killed_at
    noticed = replaced = None
    while load.now() - killed_at < wait_s:
        state = replicas()
        t = load.now() - killed_at
        if noticed is None and not any(r["id"] in lost_ids and r["state"] == "RUNNING"
                                       for tier in lost_tiers for r in state[tier]):
            noticed = t
        if all(running(state, tier, excluding=lost_ids) >= want[tier] for tier in lost_tiers):
            replaced = t
            break
        time.sleep(POLL_S)
    new_nodes = {tier: sorted({node_kind(r["node_id"]) for r in state[tier] if r["state"] == "RUNNING"})
                 for tier in lost_tiers}
    return {"kind": kind, "node": node_id[:12],
            "lost": {tier: sum(t == tier for t, _ in lost) for tier in lost_tiers},
            "ongoing_on_the_lost_replicas": working[node_id],
            "killed_at_s": round(killed_at, 2), "kill_took_s": round(killed_in_s, 2),
            "noticed_s": round(noticed, 2) if noticed is not None else None,
            "replaced_s": round(replaced, 2) if replaced is not None else None,
            "replacements_on": new_nodes}


def longest_gap(log: list[dict], since: float, until: float) -> float:
    """The longest time in [since, until] in which no request was answered 200."""
    ends = sorted(e["end_s"] for e in log if e["outcome"] == "ok" and since <= e["end_s"] <= until)
    marks = [since, *ends, until]
    return round(max(b - a for a, b in zip(marks, marks[1:])), 2)


def node_loss(cluster: PrivateCluster, port: int, settings: Settings, config: dict | None = None) -> dict:
    """`config` (the updated cpu-cluster.yaml by default: one replica of each encoder tier, two
    Decoder replicas) under load; an encoder node killed while its replicas work on requests,
    then, once what it held is replaced, a decoder node while its Decoder holds two requests or
    more; returns the summary and every request."""
    url = f"http://127.0.0.1:{port}"
    config = config or updated(serve_config(port))
    deploy(config)
    ready(url)
    want = targets(config)
    before = replicas()
    t0 = time.monotonic()
    losses = []
    with Load(url, settings, request_bodies(settings, seed=1), t0) as load:
        time.sleep(settings.warmup_s)
        streams_begun(load)
        # The Decoder: when it holds two requests or more (one may be a stream, which cannot be
        # carried over: the other is a whole answer, whose generation the Router retries).
        for kind, tiers, busy in (("encoder", ("GlobalEncoder", "LocalEncoder"), 1), ("decoder", ("Decoder",), 2)):
            loss = lose_node(cluster, load, kind, tiers, want, settings.wait_s, busy)
            time.sleep(settings.after_s)
            loss["longest_without_a_200_s"] = longest_gap(load.log, loss["killed_at_s"], load.now())
            losses.append(loss)
        load.stop()
    log = load.log
    for loss in losses:  # what was in flight when the node went
        at = loss["killed_at_s"]
        across = [e for e in log if e["start_s"] < at < (e["end_s"] or math.inf)]
        plain = [e for e in across if e["kind"] == "plain"]
        loss["in_flight_at_the_kill"] = {
            "requests": len(across), "whole_answers": len(plain),
            "whole_answers_ok": sum(e["outcome"] == "ok" for e in plain),
            "streams_generating": sum(e["kind"] == "stream" and e.get("first_event_s") is not None
                                      and e["first_event_s"] < at for e in across),
            "interrupted": sum(e["outcome"] == "interrupted" for e in across)}
    summary = {
        "config": "cpu-cluster.yaml, updated: " + json.dumps({"args": UPDATE_ARGS, "replicas": UPDATE_REPLICAS}),
        "settings": asdict(settings),
        "requests": outcomes(log), **latencies(log),
        "losses": losses,
        "replicas_before": {t: running(before, t) for t in TIERS},
        "replicas_after": {t: running(replicas(), t) for t in TIERS},
        "ready_after": ready(url)["status"],
    }
    return {"summary": summary, "requests": log}


# --- the whole run ------------------------------------------------------------------------------
class OpsCluster(PrivateCluster):
    """The head and NODES' worker nodes (bench/autoscale_timeline.py's PrivateCluster)."""

    def __init__(self):
        super().__init__(HEAD_CPUS)

    def __enter__(self) -> OpsCluster:
        super().__enter__()
        try:
            for _, resources in NODES:
                self.add_node(resources)
        except BaseException:
            self.__exit__(*sys.exc_info())
            raise
        return self


def run(settings: dict[str, Settings]) -> dict:
    """Both, on one fresh cluster: the rolling update, then node loss (on the updated app)."""
    started = time.monotonic()
    port = free_port()
    with OpsCluster() as cluster:
        update = rolling_update(port, settings["update"])
        loss = node_loss(cluster, port, settings["loss"])
    summary = {"rolling_update": update["summary"], "node_loss": loss["summary"],
               "nodes": [{"type": kind, "resources": resources} for kind, resources in NODES],
               "wall_s": round(time.monotonic() - started, 1),
               "machine": f"{os.cpu_count()} CPU cores, no GPU"}
    return {"summary": summary, "rolling_update": {k: v for k, v in update.items() if k != "summary"},
            "node_loss": {k: v for k, v in loss.items() if k != "summary"}}


def brief(summary: dict) -> str:
    """The figures, in a few lines."""
    lines = []
    if "rolling_update" in summary:
        u = summary["rolling_update"]
        r = u["requests"]
        lines.append(f"rolling update: {r['total']} requests, {r['ok']} ok, {r['refused']} refused, "
                     f"{r['interrupted']} interrupted, {r['failed']} failed ({r['by_kind']}); "
                     f"update took {u['update_s']} s; "
                     f"in flight at the update {u['in_flight_at_update']}; streams on the old Decoder "
                     f"when it stopped {u['streams_on_the_old_decoder_when_it_stopped']}; requests on "
                     f"the old Router when it stopped {u['requests_on_the_old_router_when_it_stopped']}; "
                     f"replicas {u['replicas_before']} -> {u['replicas_after']}; "
                     f"Decoder max_batch {u['decoder_max_batch_before']} -> {u['decoder_max_batch_after']}")
    if "node_loss" in summary:
        n = summary["node_loss"]
        r = n["requests"]
        lines.append(f"node loss: {r['total']} requests, {r['ok']} ok ({r['ok_fraction']:.1%}; whole "
                     f"answers {r['plain_ok_fraction']:.1%}), {r['refused']} refused, {r['interrupted']} "
                     f"streams interrupted (retryable error event), {r['failed']} failed ({r['by_kind']})")
        for loss in n["losses"]:
            lines.append(f"  {loss['kind']} node lost ({loss['lost']}): Serve noticed after "
                         f"{loss['noticed_s']} s, replaced after {loss['replaced_s']} s "
                         f"(on {loss['replacements_on']}); longest without a 200: "
                         f"{loss['longest_without_a_200_s']} s; in flight at the kill: "
                         f"{loss['in_flight_at_the_kill']}")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=RESULTS)
    parser.add_argument("--short", action="store_true", help="the test's shorter settings")
    opts = parser.parse_args(argv)
    # A SIGTERM (a CI timeout) ends the run through the cluster's shutdown, not around it.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    result = run(SHORT if opts.short else FULL)
    path = write_json(result, os.path.join(opts.out, "cluster-operations-cpu.json"))
    print(json.dumps(result["summary"], indent=1))
    print(brief(result["summary"]))
    print("wrote", path)


if __name__ == "__main__":
    main()
