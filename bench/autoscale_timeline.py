"""Tiers that scale apart on an autoscaling Ray cluster, on CPU: a load ramp against the tiny
model on Ray's fake multi-node cluster, and the timeline of what scaled.

    python bench/autoscale_timeline.py                  # the full ramp (~5 min on 2 cores)
    python bench/autoscale_timeline.py --short --out /tmp/timeline   # the test's shorter ramp
    python bench/autoscale_timeline.py --fixed_replicas  # autoscaling off: each tier at its minimum

Starts a Ray cluster on this machine whose autoscaler is Ray's own, with its fake node provider
(the one `ray.cluster_utils.AutoscalingCluster` uses): worker nodes are process trees it
starts and stops here, of the types in NODE_TYPES, which mirror cluster.yaml's groups. The
head takes the Router; encoder nodes declare `encoder_gpu` and decoder nodes `decoder_gpu`, the
custom resources the GPU tiers ask for in deployments/configs/gpu-separate.yaml, and
deployments/configs/cpu-autoscaling.yaml (deployed here) asks for the same ones. Then a closed
loop of HTTP clients ramps 0 -> peak -> 0: an image-heavy phase (three A4 pages a request,
4 tokens generated) and a text-heavy phase (one small image, hundreds of tokens), so that the
encoders, then the decoder, are the tier that is short. After the ramp it waits until the
cluster is back at its minimum (replicas and nodes). Every second it records each tier's
replicas, the nodes of each type, requests/s by outcome and p50 / p99 latency; writes
autoscaling-timeline-cpu.json (top-level `summary`) and autoscaling-timeline-cpu.png to --out
(bench/results).

Every request must end as 200, or as 503 / 429 with Retry-After (the client then waits that
long); anything else is counted: another status as an error, no answer within
REQUEST_TIMEOUT_S as hung, a broken connection as lost.
"""
from __future__ import annotations

import argparse
import base64
import json
import math
import os
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import requests
import yaml

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
from bench.workload import uniform_page  # noqa: E402
from deployments import STARTUP_ENVIRONMENT  # noqa: E402
from tests.helpers import free_port  # noqa: E402

RESULTS = os.path.join(ROOT, "bench", "results")
CONFIG = os.path.join(ROOT, "deployments", "configs", "cpu-autoscaling.yaml")
APP = "ocr"
TIERS = ("GlobalEncoder", "LocalEncoder", "Decoder")
# A node's type, told by the custom resource it declares (the head declares neither).
NODE_KINDS = {"encoder_gpu": "encoder", "decoder_gpu": "decoder"}
TIER_NODES = {"GlobalEncoder": "encoder", "LocalEncoder": "encoder", "Decoder": "decoder"}
# The fake cluster's worker node types, as cluster.yaml's GPU groups: an encoder node has two
# "GPUs" (both paths' first replicas fit on one node, a third encoder replica needs another),
# a decoder node one. No CPUs: a tier node takes only its tier (cpu-autoscaling.yaml gives the
# tiers num_cpus 0), and the Router stays on the head. Small object stores: one machine's
# memory holds them all.
OBJECT_STORE_BYTES = 256 << 20
NODE_TYPES = {
    "encoder_node": {"resources": {"CPU": 0, "encoder_gpu": 2, "object_store_memory": OBJECT_STORE_BYTES},
                     "node_config": {}, "min_workers": 1, "max_workers": 2},
    "decoder_node": {"resources": {"CPU": 0, "decoder_gpu": 1, "object_store_memory": OBJECT_STORE_BYTES},
                     "node_config": {}, "min_workers": 1, "max_workers": 2},
}
HEAD_CPUS = 1  # the Router's (cpu-autoscaling.yaml); Serve's controller and proxy take none
IDLE_TIMEOUT_S = 10  # an idle worker node above its type's minimum goes after this long
REQUEST_TIMEOUT_S = 120  # a request with no answer after this long is hung
LATENCY_WINDOW_S = 5  # p50 / p99 at each second: of the requests answered in the last 5 s


@dataclass(frozen=True)
class Phase:
    """One kind of request, sent for `seconds`."""

    name: str
    seconds: float
    images: int  # per request
    image_size: tuple[int, int]
    mode: str
    max_tokens: int


@dataclass(frozen=True)
class Ramp:
    """Clients in flight over time: 0 -> peak over ramp_s from the start, peak until ramp_s
    before the last phase ends, then down to 0; the phases follow one another."""

    peak: int
    ramp_s: float
    phases: tuple[Phase, ...]
    tail_s: float  # after the load, at most this long waiting for the cluster's minimum

    @property
    def load_s(self) -> float:
        return sum(p.seconds for p in self.phases)

    def clients(self, t: float) -> int:
        rising, falling = t / self.ramp_s, (self.load_s - t) / self.ramp_s
        return max(0, math.ceil(self.peak * min(1.0, rising, falling)))

    def phase_at(self, t: float) -> Phase | None:
        for phase in self.phases:
            if t < phase.seconds:
                return phase
            t -= phase.seconds
        return None

    def phase_starts(self) -> dict[str, float]:
        starts, t = {}, 0.0
        for phase in self.phases:
            starts[phase.name] = t
            t += phase.seconds
        return starts


# Image-heavy: three A4 pages of 1191 x 1684 (6 crops each) and 4 tokens: ~1.2 s of encoding
# and ~0.1 s in the decoder, alone. Text-heavy: one 320 x 240 image (`tiny` mode, 73 tokens)
# and 256 tokens: ~35 ms of encoding and ~1.4 s of decoding, alone. The peak (10 clients) is
# above the Router's 8 requests in flight (cpu-autoscaling.yaml): some are refused.
IMAGE_HEAVY = dict(name="image-heavy", images=3, image_size=(1191, 1684), mode="gundam", max_tokens=4)
TEXT_HEAVY = dict(name="text-heavy", images=1, image_size=(320, 240), mode="tiny", max_tokens=256)
FULL = Ramp(peak=10, ramp_s=20, tail_s=150,
            phases=(Phase(seconds=80, **IMAGE_HEAVY), Phase(seconds=80, **TEXT_HEAVY)))
# The test's ramp sends one page a request, not three: beside the other half of the suite on 2
# cores, three pages a request took ~66 s each (p50), so the image-heavy requests still held
# the Router's slots through the text-heavy phase and the Decoder never saw its load.
SHORT = Ramp(peak=10, ramp_s=6, tail_s=100,
             phases=(Phase(seconds=35, **{**IMAGE_HEAVY, "images": 1}), Phase(seconds=35, **TEXT_HEAVY)))


def serve_config(port: int, fixed_replicas: bool) -> dict:
    """cpu-autoscaling.yaml on `port`; fixed_replicas: every tier at its minimum, no
    autoscaling (the control run: nothing should scale)."""
    with open(CONFIG) as f:
        config = yaml.safe_load(f)
    config["http_options"]["port"] = port
    if fixed_replicas:
        for deployment in config["applications"][0]["deployments"]:
            autoscaling = deployment.pop("autoscaling_config", None)
            if autoscaling:
                deployment["num_replicas"] = autoscaling["min_replicas"]
    return config


def tier_resources(config: dict) -> dict[str, dict]:
    """Each deployment's custom resources in a Serve config."""
    return {d["name"]: d.get("ray_actor_options", {}).get("resources", {})
            for d in config["applications"][0].get("deployments", [])}


@contextmanager
def environment(**values: str):
    """os.environ with `values` set, as it was afterwards (the cluster's processes inherit it)."""
    before = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


class PrivateCluster:
    """A multi-node Ray cluster on this machine only, from `ray.cluster_utils.Cluster` (which
    ends only the processes it started; never `ray stop`): a private RAY_TMPDIR, so its address
    file never makes another process's `ray.init()` on this machine join it, free ports, the
    app's start-up environment, and a shutdown that ends every process of it (by pid) even on
    failure. Worker nodes are added and killed by hand (`add_node`, `kill_node`); the driver is
    connected (`ray.init`) while it runs."""

    temp_prefix = "raycl-"

    def __init__(self, head_cpus: int):
        self.head_cpus = head_cpus
        self.cluster = None
        self.temp_dir = None
        self._environment = None

    def _setup(self, gcs_address: str) -> tuple[dict, dict]:
        """The head's extra arguments and the cluster's extra environment (a subclass's)."""
        return {}, {}

    def __enter__(self):
        import ray
        from ray.cluster_utils import Cluster

        self.temp_dir = tempfile.mkdtemp(prefix=self.temp_prefix, dir="/tmp")  # short: socket paths
        gcs_port = free_port()
        head_args, extra_environment = self._setup(f"{ray.util.get_node_ip_address()}:{gcs_port}")
        self._environment = environment(
            RAY_TMPDIR=self.temp_dir,
            **extra_environment,
            **STARTUP_ENVIRONMENT,  # as cluster.yaml's nodes
        )
        self._environment.__enter__()
        try:
            if ray.is_initialized():
                ray.shutdown()
            self.cluster = Cluster(initialize_head=True, head_node_args=dict(
                num_cpus=self.head_cpus, gcs_server_port=gcs_port, **head_args,
                include_dashboard=False, dashboard_port=free_port(), dashboard_agent_listen_port=free_port(),
                object_store_memory=OBJECT_STORE_BYTES))
            # The replicas' logs stay in the session's files: every fake node runs its own log
            # monitor over the same directory, so the driver would print each line per node.
            ray.init(address=self.cluster.address, log_to_driver=False)
        except BaseException:
            self.__exit__(*sys.exc_info())
            raise
        return self

    def add_node(self, resources: dict, num_cpus: int = 0):
        """A worker node declaring `resources` (custom resources: what tells its type), started
        now; returns its `ray._private.node.Node` (`.node_id`)."""
        return self.cluster.add_node(num_cpus=num_cpus, resources=resources,
                                     object_store_memory=OBJECT_STORE_BYTES)

    def kill_node(self, node) -> None:
        """The worker node lost, as a machine that goes: every process of it SIGKILLed at
        once, its workers (the replicas) with its raylet. (Killing the raylet alone leaves its
        workers running for up to a second or so, until they notice, and a call in flight on
        one may still finish: no machine loss does that.)"""
        import psutil
        processes = []
        for infos in node.all_processes.values():
            for info in infos:
                try:
                    root = psutil.Process(info.process.pid)
                    processes += [*root.children(recursive=True), root]
                except psutil.NoSuchProcess:
                    pass
        for process in processes:
            try:
                process.kill()
            except psutil.NoSuchProcess:
                pass
        self.cluster.remove_node(node, allow_graceful=False)  # reaps them; the cluster forgets the node

    def _processes(self) -> list:
        """Every process of this cluster: every node's, and under them (the autoscaler's
        monitor) the fake worker nodes' and every node's workers."""
        import psutil  # Ray's bundled copy
        found = []
        nodes = [self.cluster.head_node, *self.cluster.worker_nodes]
        for node in nodes:
            for infos in node.all_processes.values():
                for info in infos:
                    try:
                        root = psutil.Process(info.process.pid)
                        found += [root, *root.children(recursive=True)]
                    except psutil.NoSuchProcess:
                        pass
        return found

    def __exit__(self, *exc) -> None:
        import psutil
        import ray
        from ray import serve
        try:
            processes = self._processes() if self.cluster and self.cluster.head_node else []
            if ray.is_initialized():
                try:
                    serve.shutdown()
                except Exception as e:  # noqa: BLE001 - the cluster goes anyway
                    print("serve.shutdown:", e, file=sys.stderr)
                ray.shutdown()
            if self.cluster is not None:
                self.cluster.shutdown()
            # The fake worker nodes were started by the monitor, which is gone now: end what is
            # left of them (by pid: these processes only).
            alive = [p for p in processes if p.is_running()]
            for p in alive:
                try:
                    p.terminate()
                except psutil.NoSuchProcess:
                    pass
            _, alive = psutil.wait_procs(alive, timeout=10)
            for p in alive:
                try:
                    p.kill()
                except psutil.NoSuchProcess:
                    pass
        finally:
            if self._environment is not None:
                self._environment.__exit__(None, None, None)
            if self.temp_dir:
                shutil.rmtree(self.temp_dir, ignore_errors=True)


class FakeAutoscalingCluster(PrivateCluster):
    """A head node with Ray's autoscaler and its fake node provider, on this machine only.

    Not `ray.cluster_utils.AutoscalingCluster` itself: in Ray 2.60 its start runs `ray stop
    --force` (every Ray process of the machine, another test suite's too) and reads an example
    YAML that the wheel does not ship. This is the same cluster built from
    `ray.cluster_utils.Cluster` (`PrivateCluster`: private RAY_TMPDIR, free ports, only its own
    processes ended) and an autoscaling config written here."""

    temp_prefix = "rayas-"

    def __init__(self, node_types: dict, head_cpus: int, idle_timeout_s: float):
        super().__init__(head_cpus)
        self.node_types, self.idle_timeout_s = node_types, idle_timeout_s

    def _setup(self, gcs_address: str) -> tuple[dict, dict]:
        config_path = os.path.join(self.temp_dir, "autoscaling.json")
        with open(config_path, "w") as f:
            json.dump(self._autoscaling_config(gcs_address), f)
        return {"autoscaling_config": config_path}, {
            "RAY_FAKE_CLUSTER": "1",  # the fake node provider refuses to run without it
            "AUTOSCALER_UPDATE_INTERVAL_S": "1",  # the autoscaler's loop: every second, not 5
        }

    def _autoscaling_config(self, gcs_address: str) -> dict:
        """The cluster launcher's config for the fake provider (the keys of Ray's
        fake_multi_node/example.yaml), with this cluster's node types."""
        workers = sum(t["max_workers"] for t in self.node_types.values())
        return {
            "cluster_name": "fake-autoscaling", "max_workers": workers,
            "provider": {"type": "fake_multinode", "use_node_id_as_ip": True,
                         "disable_node_updaters": True, "disable_launch_config_check": True,
                         "gcs_address": gcs_address},
            "available_node_types": {
                "ray.head.default": {"resources": {"CPU": self.head_cpus}, "node_config": {},
                                     "max_workers": 0},
                **self.node_types},
            "head_node_type": "ray.head.default",
            "idle_timeout_minutes": self.idle_timeout_s / 60, "upscaling_speed": 1.0,
            "auth": {}, "docker": {}, "file_mounts": {}, "cluster_synced_files": [],
            "file_mounts_sync_continuously": False, "rsync_exclude": [], "rsync_filter": [],
            "initialization_commands": [], "setup_commands": [], "head_setup_commands": [],
            "worker_setup_commands": [], "head_start_ray_commands": [], "worker_start_ray_commands": [],
        }


def deploy(config: dict, timeout_s: float = 300) -> None:
    """The Serve config on the connected cluster, as `serve run config.yaml` deploys it;
    returns once the app runs (its minimum replicas up, on the nodes the autoscaler started)."""
    from ray import serve
    from ray.serve._private.api import serve_start
    from ray.serve.schema import ServeDeploySchema
    schema = ServeDeploySchema.model_validate(config)
    client = serve_start(http_options=config["http_options"], proxy_location=schema.proxy_location)
    client.deploy_apps(schema)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        app = serve.status().applications.get(APP)
        if app is not None and app.status == "RUNNING":
            return
        if app is not None and app.status == "DEPLOY_FAILED":
            raise RuntimeError(f"deploy failed: {app.message}")
        time.sleep(1)
    raise TimeoutError(f"the app was not running after {timeout_s} s")


def cluster_state() -> dict:
    """Each tier's replicas (running; wanted: running or starting, i.e. what Serve's
    autoscaler asks for) and the alive nodes of each type."""
    import ray
    from ray import serve
    deployments = serve.status().applications[APP].deployments
    running, wanted = {}, {}
    for tier in TIERS:
        states = {getattr(k, "value", k): v for k, v in deployments[tier].replica_states.items()}
        running[tier] = states.get("RUNNING", 0)
        wanted[tier] = sum(n for state, n in states.items() if state not in ("STOPPING", "STOPPED"))
    nodes = {"head": 0, "encoder": 0, "decoder": 0}
    for node in ray.nodes():
        if node["Alive"]:
            kinds = [kind for resource, kind in NODE_KINDS.items() if resource in node["Resources"]]
            nodes[kinds[0] if kinds else "head"] += 1
    return {"replicas": running, "wanted": wanted, "nodes": nodes}


def request_bodies(phase: Phase, count: int, seed: int) -> list[bytes]:
    """`count` JSON bodies of `phase`'s kind, every page different (the encoder cache is off
    in cpu-autoscaling.yaml, so bodies are reused round-robin)."""
    rng = random.Random(seed)
    bodies = []
    for _ in range(count):
        images = [base64.b64encode(uniform_page(rng.randrange(1 << 30), phase.image_size)).decode()
                  for _ in range(phase.images)]
        bodies.append(json.dumps({"images": images, "prompt": "<image>" * phase.images + "\nFree OCR.",
                                  "mode": phase.mode, "max_tokens": phase.max_tokens}).encode())
    return bodies


def outcome_of(response: requests.Response) -> str:
    if response.status_code == 200:
        return "ok"
    if response.status_code in (429, 503):
        return "refused" if response.headers.get("Retry-After") else "refused_without_retry_after"
    return f"error_{response.status_code}"


def run_clients(url: str, ramp: Ramp, bodies: dict[str, list[bytes]], t0: float, log: list) -> None:
    """PEAK client threads, each sending one request at a time while the ramp counts it in;
    every request's phase, start, end, status and outcome go to `log`."""
    def client(index: int) -> None:
        session, sent = requests.Session(), 0
        while (t := time.monotonic() - t0) < ramp.load_s:
            phase = ramp.phase_at(t)
            if phase is None or index >= ramp.clients(t):
                time.sleep(0.2)
                continue
            body = bodies[phase.name][(index + sent * ramp.peak) % len(bodies[phase.name])]
            sent += 1
            start = time.monotonic()
            entry = {"phase": phase.name, "start_s": start - t0, "status": None}
            try:
                response = session.post(url, data=body, headers={"content-type": "application/json"},
                                        timeout=(10, REQUEST_TIMEOUT_S))
                entry.update(status=response.status_code, outcome=outcome_of(response),
                             retry_after=response.headers.get("Retry-After"))
            except requests.Timeout:
                entry["outcome"] = "hung"
            except requests.RequestException as e:
                entry.update(outcome="lost", error=type(e).__name__)
            entry["end_s"] = time.monotonic() - t0
            log.append(entry)  # list.append is atomic
            if entry["outcome"] == "refused":
                time.sleep(float(entry["retry_after"]))  # as a client honouring Retry-After

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(ramp.peak)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def at_minimum(state: dict, minimum: dict) -> bool:
    return state["wanted"] == minimum["wanted"] and state["nodes"] == minimum["nodes"]


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(math.ceil(q / 100 * len(ordered))) - 1)]


def run(ramp: Ramp, fixed_replicas: bool = False, bodies_per_phase: int = 6) -> dict:
    """The whole run on a fresh fake cluster: the timeline and its summary."""
    bodies = {phase.name: request_bodies(phase, bodies_per_phase, seed=i)
              for i, phase in enumerate(ramp.phases)}
    port = free_port()
    config = serve_config(port, fixed_replicas)
    started = time.monotonic()
    with FakeAutoscalingCluster(NODE_TYPES, HEAD_CPUS, IDLE_TIMEOUT_S):
        deploy(config)
        ready_s = time.monotonic() - started
        minimum = cluster_state()  # every tier at its minimum, nodes at their types' minimum
        samples, log = [], []
        t0 = time.monotonic()
        load = threading.Thread(target=run_clients, args=(f"http://127.0.0.1:{port}/v1/ocr", ramp,
                                                          bodies, t0, log), daemon=True)
        load.start()
        settled_since = None
        while True:
            t = time.monotonic() - t0
            state = cluster_state()
            phase = ramp.phase_at(t)
            samples.append({"t_s": round(t, 2), "phase": phase.name if phase else "after",
                            "clients": ramp.clients(t), **state})
            if t > ramp.load_s and not load.is_alive():
                # Back at the minimum for a few seconds (not a momentary dip), or out of time.
                settled_since = (settled_since or t) if at_minimum(state, minimum) else None
                if (settled_since and t - settled_since >= 5) or t > ramp.load_s + ramp.tail_s:
                    break
            time.sleep(max(0.0, 1.0 - (time.monotonic() - t0 - t)))
        load.join(timeout=REQUEST_TIMEOUT_S + 30)
    result = timeline(samples, log, ramp, minimum, config)
    result["summary"].update(fixed_replicas=fixed_replicas, cluster_ready_s=round(ready_s, 1),
                             wall_s=round(time.monotonic() - started, 1))
    return result


def timeline(samples: list[dict], log: list[dict], ramp: Ramp, minimum: dict, config: dict) -> dict:
    """Per-sample request rates and latencies; scale and node events; the summary."""
    for previous, sample in zip([None, *samples], samples):
        since = previous["t_s"] if previous else 0.0
        done = [r for r in log if since <= r["end_s"] < sample["t_s"]]
        seconds = max(sample["t_s"] - since, 1e-3)
        sample["requests_per_s"] = round(len(done) / seconds, 2)
        sample["ok_per_s"] = round(sum(r["outcome"] == "ok" for r in done) / seconds, 2)
        sample["refused_per_s"] = round(sum(r["outcome"] == "refused" for r in done) / seconds, 2)
        window = [(r["end_s"] - r["start_s"]) * 1e3 for r in log
                  if r["outcome"] == "ok" and sample["t_s"] - LATENCY_WINDOW_S <= r["end_s"] < sample["t_s"]]
        sample["p50_ms"], sample["p99_ms"] = percentile(window, 50), percentile(window, 99)

    scale_events, node_events = [], []
    for previous, sample in zip(samples, samples[1:]):
        for tier in TIERS:
            before, after = previous["wanted"][tier], sample["wanted"][tier]
            if after != before:
                scale_events.append({"t_s": sample["t_s"], "tier": tier, "from": before, "to": after})
        for kind in ("encoder", "decoder"):
            before, after = previous["nodes"][kind], sample["nodes"][kind]
            if after != before:
                node_events.append({"t_s": sample["t_s"], "type": kind, "event":
                                    "added" if after > before else "removed", "from": before, "to": after})

    # A scaling decision belongs to the phase it was taken in: with metrics every second, a
    # tier's decision follows its load within seconds (the Decoder scaled 3-11 s into the
    # text-heavy phase), so a fixed lag added to each phase's start miscounted the fast ones. A
    # node added belongs to the phase of the scale-up that asked for it: the latest scale-up,
    # before it, of a tier that runs on that node type (for a node removed: that of the
    # scale-up that had asked for it).
    # A tier grows in a phase when it goes past the replicas it had as the phase began: one that
    # scaled down within the phase and came back to that count (its load eased, then returned on
    # 2 busy cores) has asked for nothing the phase did not start with.
    starts = ramp.phase_starts()
    bounds = list(starts.values())[1:] + [ramp.load_s + ramp.tail_s]

    def phase_at(t: float) -> str:
        return [name for name, start in starts.items() if start <= t][-1] if t >= 0 else next(iter(starts))

    def wanted_at(tier: str, t: float) -> int:
        earlier = [e["to"] for e in scale_events if e["tier"] == tier and e["t_s"] < t]
        return earlier[-1] if earlier else samples[0]["wanted"][tier]
    ups = [e for e in scale_events if e["to"] > max(e["from"], wanted_at(e["tier"], starts[phase_at(e["t_s"])]))]

    for event in node_events:
        causes = [e for e in ups if TIER_NODES[e["tier"]] == event["type"] and e["t_s"] <= event["t_s"]]
        event["phase"] = phase_at(causes[-1]["t_s"] if causes else event["t_s"])
    phases = {}
    for (name, start), end in zip(starts.items(), bounds):
        taken = [e for e in ups if start <= e["t_s"] < end]
        added = [e for e in node_events if e["event"] == "added" and e["phase"] == name]
        answered = [r for r in log if r["phase"] == name]
        latencies = [(r["end_s"] - r["start_s"]) * 1e3 for r in answered if r["outcome"] == "ok"]
        phase = next(p for p in ramp.phases if p.name == name)
        phases[name] = {
            **asdict(phase), "start_s": start, "end_s": end,
            "first_scale_up": taken[0] if taken else None,
            "tiers_scaled_up": sorted({e["tier"] for e in taken}),
            "node_types_added": sorted({e["type"] for e in added}),
            "requests": len(answered), "ok": len(latencies),
            "p50_ms": percentile(latencies, 50), "p99_ms": percentile(latencies, 99)}

    outcomes: dict[str, int] = {}
    for r in log:
        outcomes[r["outcome"]] = outcomes.get(r["outcome"], 0) + 1
    peak = {key: {name: max(s[key][name] for s in samples) for name in samples[0][key]}
            for key in ("wanted", "nodes")}
    final = samples[-1]
    summary = {
        "config": os.path.relpath(CONFIG, ROOT), "node_types": NODE_TYPES,
        "idle_timeout_s": IDLE_TIMEOUT_S, "peak_clients": ramp.peak, "ramp_s": ramp.ramp_s,
        "load_s": ramp.load_s, "phases": phases,
        "requests": {"total": len(log), **dict(sorted(outcomes.items()))},
        "every_request_answered": all(r["outcome"] in ("ok", "refused") for r in log),
        "scale_events": scale_events, "node_events": node_events,
        "minimum": minimum, "peak": peak,
        "end": {"t_s": final["t_s"], "wanted": final["wanted"], "nodes": final["nodes"]},
        "back_at_minimum": at_minimum(final, minimum),
        "machine": f"{os.cpu_count()} CPU cores, no GPU",
    }
    return {"summary": summary, "timeline": samples, "requests": log}


def plot(result: dict, path: str) -> str:
    import matplotlib  # the bench extra (pyproject's `bench`), imported only to plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples, summary = result["timeline"], result["summary"]
    t = [s["t_s"] for s in samples]
    fig, (replicas, nodes, load) = plt.subplots(3, 1, figsize=(10, 8), sharex=True)
    # Equal counts would hide one another: each line is drawn a little off its integer.
    for (tier, color), offset in zip(zip(TIERS, ("#6699cc", "#33aa77", "#cc6633")), (-0.04, 0.0, 0.04)):
        replicas.step(t, [s["wanted"][tier] + offset for s in samples], where="post", color=color,
                      label=f"{tier} (wanted)")
        replicas.step(t, [s["replicas"][tier] + offset for s in samples], where="post", color=color,
                      linestyle=":", label=f"{tier} (running)")
    replicas.set_ylabel("replicas")
    replicas.legend(fontsize=7, ncol=3, loc="upper right")
    for (kind, color), offset in zip((("encoder", "#33aa77"), ("decoder", "#cc6633")), (-0.02, 0.02)):
        nodes.step(t, [s["nodes"][kind] + offset for s in samples], where="post", color=color,
                   label=f"{kind} nodes")
    nodes.set_ylabel("worker nodes")
    nodes.legend(fontsize=7, loc="upper right")
    for axis, top in ((replicas, max(max(s["wanted"].values()) for s in samples)),
                      (nodes, max(max(s["nodes"].values()) for s in samples))):
        axis.set_yticks(range(0, top + 2))
        axis.set_ylim(0.5, top + 0.8)
    load.bar(t, [s["ok_per_s"] for s in samples], width=0.9, color="#99bbdd", label="200/s")
    load.bar(t, [s["refused_per_s"] for s in samples], width=0.9, bottom=[s["ok_per_s"] for s in samples],
             color="#ddaa55", label="503 + Retry-After /s")
    load.step(t, [s["clients"] for s in samples], where="post", color="#888888", linewidth=1,
              label="clients (the ramp)")
    load.set_ylabel("requests/s; clients")
    load.set_xlabel("seconds since the ramp began")
    latency = load.twinx()
    for key, style in (("p50_ms", "-"), ("p99_ms", "--")):
        latency.plot(t, [(s[key] or float("nan")) / 1e3 for s in samples], "k" + style, linewidth=1,
                     label=f"{key[:3]} latency (last {LATENCY_WINDOW_S} s)")
    latency.set_ylabel("latency, s")
    handles = [*load.get_legend_handles_labels()[0], *latency.get_legend_handles_labels()[0]]
    labels = [*load.get_legend_handles_labels()[1], *latency.get_legend_handles_labels()[1]]
    load.legend(handles, labels, fontsize=7, loc="upper right")
    for axis in (replicas, nodes, load):
        for name, phase in summary["phases"].items():
            axis.axvspan(phase["start_s"], phase["start_s"] + phase["seconds"], alpha=0.08,
                         color="#6699cc" if name == "image-heavy" else "#cc6633")
    for name, phase in summary["phases"].items():
        replicas.text(phase["start_s"] + 1, 0.6, name, fontsize=8, color="#555555")
    replicas.set_title("Tiers scaling apart on Ray's fake autoscaling cluster (tiny model, CPU): "
                       "image-heavy, then text-heavy", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_json(result: dict, path: str) -> str:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    return path


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=RESULTS)
    parser.add_argument("--short", action="store_true", help="the test's shorter ramp")
    parser.add_argument("--fixed_replicas", action="store_true",
                        help="autoscaling off: every tier at its minimum (the control run)")
    opts = parser.parse_args(argv)
    # A SIGTERM (a CI timeout) ends the run through the cluster's shutdown, not around it.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    result = run(SHORT if opts.short else FULL, fixed_replicas=opts.fixed_replicas)
    path = write_json(result, os.path.join(opts.out, "autoscaling-timeline-cpu.json"))
    plot(result, path.replace(".json", ".png"))
    print(json.dumps({k: v for k, v in result["summary"].items() if k != "node_types"}, indent=1))
    print("wrote", path, "and its .png")


if __name__ == "__main__":
    main()
