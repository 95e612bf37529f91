"""cluster.yaml against Ray's own schema; the Serve configs against Serve's schema; builder args."""
import copy
import json
import os
import sys

import pytest
import yaml

ray = pytest.importorskip("ray")
import jsonschema  # noqa: E402  (a Ray dependency)
from ray.serve.schema import ServeDeploySchema  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(ROOT, "deployments", "configs")


def load(path):
    with open(path) as f:
        return yaml.safe_load(f)


@pytest.fixture(scope="module")
def cluster_schema():
    with open(os.path.join(os.path.dirname(ray.__file__), "autoscaler", "ray-schema.json")) as f:
        return json.load(f)


def test_cluster_yaml_matches_rays_schema(cluster_schema):
    config = load(os.path.join(ROOT, "cluster.yaml"))
    jsonschema.validate(config, cluster_schema)
    node_types = config["available_node_types"]
    assert node_types["head"]["resources"] == {"CPU": 0}  # no replicas on head
    workers = [t for name, t in node_types.items() if name != config["head_node_type"]]
    for worker in workers:
        assert 1 <= worker["min_workers"] <= worker["max_workers"]
    assert sum(t["max_workers"] for t in workers) <= config["max_workers"]
    assert any("pip install" in c and "deepseek-ocr-serve" in c for c in config["setup_commands"])


def test_nodes_start_in_the_app_s_start_up_environment_whose_modules_import():
    """cluster.yaml's and KubeRay's workers start Ray in deployments.STARTUP_ENVIRONMENT, the
    head in its proxy callback (it runs no replica); every module it names imports (Ray skips a
    preload module that fails to import, silently)."""
    import importlib

    from deployments import STARTUP_ENVIRONMENT
    config = load(os.path.join(ROOT, "cluster.yaml"))

    def starts(commands: str) -> list[str]:
        return [c for c in config[commands] if "ray start" in c]
    proxy = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
    assert starts("head_start_ray_commands") and all(
        f"{proxy}={STARTUP_ENVIRONMENT[proxy]} " in c for c in starts("head_start_ray_commands"))
    assert starts("worker_start_ray_commands") and all(
        f"{name}={value} " in c for c in starts("worker_start_ray_commands")
        for name, value in STARTUP_ENVIRONMENT.items())
    # KubeRay's containers the same: the head's proxy callback, every worker group all of it
    spec = load(os.path.join(CONFIGS, "kuberay-rayservice.yaml"))["spec"]["rayClusterConfig"]

    def env(group: dict) -> dict:
        (container,) = group["template"]["spec"]["containers"]
        return {e["name"]: e["value"] for e in container.get("env", [])}
    assert env(spec["headGroupSpec"]) == {proxy: STARTUP_ENVIRONMENT[proxy]}
    assert all(env(group) == STARTUP_ENVIRONMENT for group in spec["workerGroupSpecs"])
    for module in STARTUP_ENVIRONMENT["RAY_preload_python_modules"].split(","):
        importlib.import_module(module)
    module, function = STARTUP_ENVIRONMENT[proxy].split(":")
    assert callable(getattr(importlib.import_module(module), function))


def test_schema_check_can_fail(cluster_schema):
    config = load(os.path.join(ROOT, "cluster.yaml"))
    broken = copy.deepcopy(config)
    del broken["provider"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, cluster_schema)


def serve_configs():
    out = {name: load(os.path.join(CONFIGS, f"{name}.yaml"))
           for name in ("cpu-tiny", "cpu-two-models", "cpu-autoscaling", "cpu-cluster", "gpu-shared",
                        "gpu-separate", "gpu-shared-one-encoder", "gpu-shared-encoder-in-router")}
    out["kuberay"] = yaml.safe_load(load(os.path.join(CONFIGS, "kuberay-rayservice.yaml"))["spec"]["serveConfigV2"])
    return out


def code_defaults() -> dict:
    """Each deployment's options as the code sets them (decorators), by deployment name."""
    from deployments.decoder_server import DecoderServer
    from deployments.encoders import PathEncoder
    from deployments.router import Router
    return {name: {"max_ongoing_requests": d.max_ongoing_requests,
                   "ray_actor_options": d.ray_actor_options}
            for name, d in [("Router", Router), ("GlobalEncoder", PathEncoder),
                            ("LocalEncoder", PathEncoder), ("Encoder", PathEncoder),
                            ("Decoder", DecoderServer)]}


def expected_deployments(config: dict) -> set[str]:
    (app,) = config["applications"]
    args = app.get("args", {})

    def tiers(model: dict) -> set[str]:
        encoders = (set() if model.get("encoder_in_router") else {"Encoder"} if model.get("one_encoder")
                    else {"GlobalEncoder", "LocalEncoder"})
        return {"Decoder"} | encoders
    if "models" not in args:
        return {"Router"} | tiers(args)
    return {"Router"} | {f"{tier}-{model['name']}" for model in args["models"] for tier in tiers(model)}


def test_two_models_get_their_own_tiers():
    """cpu-two-models.yaml builds one Router and each model's tiers, named for their model."""
    from ray.serve._private.build_app import build_app

    from deployments.app import build
    from deployments.config import AppConfig
    config = serve_configs()["cpu-two-models"]
    (app,) = config["applications"]
    built = build_app(build(AppConfig.model_validate(app["args"])), name="ocr")
    assert {d.name for d in built.deployments} == expected_deployments(config) == {
        "Router", "GlobalEncoder-ocr-a", "LocalEncoder-ocr-a", "Decoder-ocr-a", "Encoder-ocr-b", "Decoder-ocr-b"}


@pytest.mark.parametrize("name", ["cpu-tiny", "cpu-two-models", "cpu-autoscaling", "cpu-cluster", "gpu-shared",
                                  "gpu-separate", "gpu-shared-one-encoder", "gpu-shared-encoder-in-router",
                                  "kuberay"])
def test_serve_configs_validate(name):
    config = serve_configs()[name]
    ServeDeploySchema.model_validate(config)
    (app,) = config["applications"]
    assert app["import_path"] == "deployments.app:build"
    defaults = code_defaults()
    if not name.startswith("cpu-"):
        assert {d["name"] for d in app["deployments"]} == expected_deployments(serve_configs()[name])
        for d in app["deployments"]:  # every tier autoscales, target below max_ongoing_requests
            auto = d["autoscaling_config"]
            max_ongoing = d.get("max_ongoing_requests", defaults[d["name"]]["max_ongoing_requests"])
            assert auto["target_ongoing_requests"] < max_ongoing
            assert 1 <= auto["min_replicas"] <= auto["max_replicas"]
    from deployments.app import build
    from deployments.config import AppConfig
    from deployments.model_source import resolve_checkpoint
    config = AppConfig.model_validate(app.get("args", {}))  # the builder takes these args
    if config.checkpoint:  # the weights' place on a GPU node; here the tiny model stands in
        config = config.model_copy(update={"checkpoint": resolve_checkpoint(None)[0]})
    build(config)


@pytest.mark.parametrize("name", ["cpu-tiny", "cpu-two-models", "cpu-autoscaling", "cpu-cluster", "gpu-shared",
                                  "gpu-separate", "gpu-shared-one-encoder", "gpu-shared-encoder-in-router"])
def test_yamls_state_only_what_differs_from_the_code(name):
    """No number is both a code default and a YAML value: a YAML restating a default would
    silently stop following the code when the default changes."""
    from deployments.config import AppConfig
    (app,) = serve_configs()[name]["applications"]
    for key, value in app.get("args", {}).items():
        assert value != AppConfig.model_fields[key].default, (name, key)
    defaults = code_defaults()
    for d in app.get("deployments", []):
        code = defaults[d["name"]]
        if "max_ongoing_requests" in d:
            assert d["max_ongoing_requests"] != code["max_ongoing_requests"], (name, d["name"])
        for key, value in d.get("ray_actor_options", {}).items():
            assert value != code["ray_actor_options"].get(key), (name, d["name"], key)


def test_kuberay_runs_the_gpu_separate_config():
    configs = serve_configs()
    assert configs["kuberay"] == configs["gpu-separate"]


# Per-tier hardware: the custom resource each GPU tier asks for where it has GPUs of its own,
# and which only its node group declares (cluster.yaml, kuberay-rayservice.yaml).
TIER_RESOURCES = {"GlobalEncoder": "encoder_gpu", "LocalEncoder": "encoder_gpu", "Encoder": "encoder_gpu",
                  "Decoder": "decoder_gpu"}


def gpu_yamls() -> list[str]:
    """Every GPU Serve config: the gpu-*.yaml files and the KubeRay file's."""
    names = sorted(f[:-len(".yaml")] for f in os.listdir(CONFIGS) if f.startswith("gpu-") and f.endswith(".yaml"))
    return names + ["kuberay"]


def tier_demands(config: dict) -> dict[str, dict]:
    """Each GPU tier's GPUs, CPUs, custom resources and replica bounds, by deployment name."""
    (app,) = config["applications"]
    demands = {}
    for d in app["deployments"]:
        options = d.get("ray_actor_options", {})
        if options.get("num_gpus", 0) > 0 and d["name"] != "Router":
            auto = d.get("autoscaling_config", {})
            demands[d["name"]] = {"gpus": options["num_gpus"], "cpus": options.get("num_cpus", 0),
                                  "resources": options.get("resources", {}),
                                  "min": auto.get("min_replicas", d.get("num_replicas", 1)),
                                  "max": auto.get("max_replicas", d.get("num_replicas", 1))}
    return demands


@pytest.mark.parametrize("name", gpu_yamls())
def test_every_gpu_yaml_gives_each_tier_its_hardware(name):
    """A tier with whole GPUs of its own asks for its tier's resource, one unit per GPU (the
    autoscaler then starts a node of its group); tiers that share one GPU (fractions) ask for
    none: a one-machine `serve run` declares no custom resources, and would never place them.
    The Router asks for none (it runs on CPUs anywhere)."""
    config = serve_configs()[name] if name == "kuberay" else load(os.path.join(CONFIGS, f"{name}.yaml"))
    demands = tier_demands(config)
    assert demands, name
    shared = any(d["gpus"] < 1 for d in demands.values())
    for tier, demand in demands.items():
        expected = {} if shared else {TIER_RESOURCES[tier]: demand["gpus"]}
        assert demand["resources"] == expected, (name, tier)
    (app,) = config["applications"]
    for d in app["deployments"]:
        if d["name"] not in demands:
            assert "resources" not in d.get("ray_actor_options", {}), (name, d["name"])


def resource_needs(config: dict) -> dict[str, dict]:
    """Per tier resource: the units its tiers need at their minimum and maximum replicas, and
    the CPUs that come with each unit (the most any of its tiers takes)."""
    needs = {}
    for demand in tier_demands(config).values():
        for resource, units in demand["resources"].items():
            need = needs.setdefault(resource, {"min": 0, "max": 0, "cpus_per_unit": 0})
            need["min"] += units * demand["min"]
            need["max"] += units * demand["max"]
            need["cpus_per_unit"] = max(need["cpus_per_unit"], demand["cpus"] / units)
    return needs


def check_node_types_provide(needs: dict, node_types: dict, cpus_known: bool) -> None:
    """Exactly one worker node type declares each tier resource; its nodes hold the tiers'
    maximum replicas (and their minimum from the start: warm nodes, as encoders take minutes to
    capture graphs), with the CPUs those replicas take where the node's CPUs are known."""
    for resource, need in needs.items():
        providers = [t for t in node_types.values() if t["resources"].get(resource, 0) > 0]
        assert len(providers) == 1, (resource, providers)
        (node,) = providers
        units = node["resources"][resource]
        assert node["max_workers"] * units >= need["max"], (resource, node)
        assert node["min_workers"] * units >= need["min"], (resource, node)
        if cpus_known:
            assert node["resources"].get("CPU", 0) >= units * need["cpus_per_unit"], (resource, node)
            assert node["resources"].get("GPU", 0) == units, (resource, node)  # one unit per GPU


def test_cluster_yaml_has_a_node_group_for_each_tier():
    """cluster.yaml's worker types provide what gpu-separate.yaml's tiers ask for (their CPUs
    and GPUs are detected from the instance type at launch, so only the custom resources are
    checked here)."""
    config = load(os.path.join(ROOT, "cluster.yaml"))
    needs = resource_needs(serve_configs()["gpu-separate"])
    assert set(needs) == {"encoder_gpu", "decoder_gpu"}
    check_node_types_provide(needs, config["available_node_types"], cpus_known=False)


def test_kuberay_has_a_worker_group_for_each_tier():
    """The KubeRay worker groups, as KubeRay's autoscaler reads them (Ray's own translation
    of a group spec into a node type: CPUs and GPUs from the container's limits, custom
    resources from rayStartParams), provide what the RayService's tiers ask for."""
    from ray.autoscaler._private.kuberay.autoscaling_config import _node_type_from_group_spec
    cluster = load(os.path.join(CONFIGS, "kuberay-rayservice.yaml"))["spec"]["rayClusterConfig"]
    node_types = {g["groupName"]: _node_type_from_group_spec(g, is_head=False) for g in cluster["workerGroupSpecs"]}
    needs = resource_needs(serve_configs()["kuberay"])
    assert set(needs) == {"encoder_gpu", "decoder_gpu"}
    check_node_types_provide(needs, node_types, cpus_known=True)
    assert cluster["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"  # no replicas on head


def test_node_type_check_can_fail():
    """The check refuses a cluster whose encoder group is missing or too small."""
    config = load(os.path.join(ROOT, "cluster.yaml"))
    needs = resource_needs(serve_configs()["gpu-separate"])
    node_types = copy.deepcopy(config["available_node_types"])
    node_types["encoder_gpu_worker"]["max_workers"] = 1
    with pytest.raises(AssertionError):
        check_node_types_provide(needs, node_types, cpus_known=False)
    del node_types["encoder_gpu_worker"]
    with pytest.raises(AssertionError):
        check_node_types_provide(needs, node_types, cpus_known=False)


def test_cpu_autoscaling_exercises_the_gpu_tiers_resources():
    """cpu-autoscaling.yaml (the fake autoscaling cluster's config) asks for gpu-separate.yaml's
    tier resources, and the fake cluster's node types (bench/autoscale_timeline.py) provide
    them, one type per resource, as cluster.yaml's groups do."""
    from bench.autoscale_timeline import NODE_KINDS, NODE_TYPES, tier_resources
    cpu, gpu = serve_configs()["cpu-autoscaling"], serve_configs()["gpu-separate"]
    gpu_tiers = {tier: resources for tier, resources in tier_resources(gpu).items() if resources}
    assert gpu_tiers and {tier: tier_resources(cpu)[tier] for tier in gpu_tiers} == gpu_tiers
    assert tier_resources(cpu)["Router"] == {}
    for resource in NODE_KINDS:
        assert [name for name, t in NODE_TYPES.items() if resource in t["resources"]], resource


def test_cpu_cluster_exercises_the_gpu_tiers_resources():
    """cpu-cluster.yaml (the hand-made cluster's config: rolling update and node loss) asks for
    gpu-separate.yaml's tier resources, each worker node of bench/cluster_operations.py declares
    one of them, and every tier, at the update's replica counts, has a second node of its type
    to go to when one is lost."""
    from bench.autoscale_timeline import tier_resources
    from bench.cluster_operations import NODES, UPDATE_REPLICAS
    cpu, gpu = serve_configs()["cpu-cluster"], serve_configs()["gpu-separate"]
    gpu_tiers = {tier: resources for tier, resources in tier_resources(gpu).items() if resources}
    assert gpu_tiers and {tier: tier_resources(cpu)[tier] for tier in gpu_tiers} == gpu_tiers
    assert tier_resources(cpu)["Router"] == {}
    (app,) = cpu["applications"]
    replicas = {d["name"]: UPDATE_REPLICAS.get(d["name"], d.get("num_replicas", 1)) for d in app["deployments"]}
    for resource in ("encoder_gpu", "decoder_gpu"):
        places = [node[resource] for _, node in NODES if resource in node]
        needed = sum(replicas[tier] * units.get(resource, 0) for tier, units in gpu_tiers.items())
        assert len(places) >= 2 and sum(places) - max(places) >= needed, (resource, places, needed)


@pytest.mark.parametrize("name", ["gpu-shared", "gpu-shared-one-encoder", "gpu-shared-encoder-in-router"])
def test_gpu_shared_fits_one_gpu(name):
    (app,) = serve_configs()[name]["applications"]
    gpus = sum(d["ray_actor_options"].get("num_gpus", 0) for d in app["deployments"])
    assert gpus == pytest.approx(1.0)
    fractions = [v for k, v in app["args"].items() if k.startswith("gpu_memory_fraction")]
    assert len(fractions) == 3 and sum(fractions) <= 0.95


@pytest.mark.parametrize("args, message", [
    ({"chekpoint": "/x"}, "chekpoint"),
    ({"max_images": "0"}, "max_images"),
    ({"gpu_memory_fraction_local": 1.5}, "gpu_memory_fraction_local"),
    ({"encoder_in_router": True, "views_on_encoder": False}, "encoder_in_router needs views_on_encoder"),
    ({"one_encoder": True, "views_on_encoder": False}, "one_encoder needs views_on_encoder"),
])
def test_app_arguments_are_checked(args, message):
    from pydantic import ValidationError

    from deployments.config import AppConfig
    with pytest.raises(ValidationError, match=message):
        AppConfig.model_validate(args)


def test_command_line_strings_become_typed_arguments():
    from deployments.config import AppConfig
    config = AppConfig.model_validate({"max_images": "8", "use_graphs": "false", "max_len": "2048"})
    assert (config.max_images, config.use_graphs, config.max_len) == (8, False, 2048)


def test_readme_documents_every_app_argument():
    """The README's table of app arguments lists exactly AppConfig's fields and defaults."""
    from deployments.config import AppConfig
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    section = readme.split("### App arguments", 1)[1].split("\n#", 1)[0]
    rows = [line.split("|")[1:3] for line in section.splitlines() if line.startswith("| `")]
    documented = {name.strip().strip("`"): default.strip().strip("`") for name, default in rows}
    expected = {name: "none" if f.default is None else str(f.default).lower()
                for name, f in AppConfig.model_fields.items()}
    assert documented == expected


def test_replicas_size_torchs_threads_as_ray_assigned(monkeypatch):
    """A preloaded worker imported torch before Ray set OMP_NUM_THREADS for its replica: the
    replica applies it (and leaves the pool alone when the variable says nothing usable)."""
    import torch

    from deployments.model_source import use_assigned_cpu_threads
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        use_assigned_cpu_threads()
        assert torch.get_num_threads() == 1
        torch.set_num_threads(2)
        monkeypatch.setenv("OMP_NUM_THREADS", "many")
        use_assigned_cpu_threads()
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


KEEP_FREED_MEMORY = """
import resource, sys
import numpy as np
from common.allocator import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
faults = []
for _ in range(4):  # a page's buffers allocated, written and freed, request after request
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    a, b = np.ones(4 << 20, np.uint8), np.ones(4 << 20, np.uint8)
    del a, b
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(*faults)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_replicas_reuse_freed_buffers_instead_of_faulting_in_new_memory():
    """With `keep_freed_memory` (every replica's start), two 4 MB buffers written and freed
    again and again fault their pages in once, not per request; with glibc's defaults (the
    control run, same script) every request faults them in anew. How many faults 8 MB costs
    depends on the kernel (fault-around, huge pages: ~1,000 here, ~700 on the CI machine), so
    the kept run is measured against the control, not a fixed count."""
    import subprocess
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def faults(mode: str) -> list[int]:
        run = subprocess.run([sys.executable, "-c", KEEP_FREED_MEMORY, mode], cwd=root, capture_output=True,
                             text=True, env=dict(os.environ, PYTHONPATH=root), timeout=60)
        assert run.returncode == 0, run.stderr
        return list(map(int, run.stdout.split()))

    kept, default = faults("keep"), faults("default")
    assert min(default[1:]) > 100, default  # the control: each request's buffers are new memory
    assert max(kept[1:]) * 10 < min(default[1:]), (kept, default)


def test_replica_allocator_setting_has_a_switch(monkeypatch):
    """prepare_replica_process keeps freed memory unless DEEPSEEK_OCR_KEEP_FREED_MEMORY=0."""
    from deployments import model_source
    calls = []
    monkeypatch.setattr(model_source, "keep_freed_memory", lambda: calls.append(1))
    model_source.prepare_replica_process()
    monkeypatch.setenv("DEEPSEEK_OCR_KEEP_FREED_MEMORY", "0")
    model_source.prepare_replica_process()
    assert calls == [1]


def test_a_replicas_gpu_memory_for_ready(monkeypatch):
    """/ready's `gpu_memory_gb` per tier: none without CUDA; with it, the allocator's holding now
    and at most, and the replica's cap (its share of the card), in GB."""
    from types import SimpleNamespace

    import torch

    from deployments import model_source
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert model_source.gpu_memory_gb() is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=80e9))
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda: 0.25)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda: 12.345e9)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda: 17.5e9)
    assert model_source.gpu_memory_gb() == {"reserved": 12.35, "peak_reserved": 17.5, "cap": 20.0}


def test_docs_list_every_switch():
    """docs/switches.md's table is common/switches.py's: every variable, its default and its
    values."""
    from common.switches import SWITCHES
    with open(os.path.join(ROOT, "docs", "switches.md")) as f:
        section = f.read().split("# Switches", 1)[1]
    rows = [line.split("|")[1:4] for line in section.splitlines() if line.startswith("| `")]
    documented = {name.strip().strip("`"): (default.strip().strip("`"), values.strip())
                  for name, default, values in rows}
    assert documented == {s.name: (s.default, " / ".join(s.choices)) for s in SWITCHES.values()}


def test_no_module_reads_a_switch_but_the_switches_module():
    """Every DEEPSEEK_OCR_* variable of the libraries is read through common/switches.py (the
    corpus command's client settings aside): one table, nothing read on the side."""
    import re
    readers = []
    for package in ("common", "encoder", "decoder", "scheduler", "deployments", "documents"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, package)):
            for name in files:
                path = os.path.join(dirpath, name)
                if name.endswith(".py") and not path.endswith(os.path.join("common", "switches.py")):
                    text = open(path).read()
                    if re.search(r"environ(?:\.get)?\(\s*[\"']DEEPSEEK_OCR_|getenv\(\s*[\"']DEEPSEEK_OCR_", text):
                        readers.append(os.path.relpath(path, ROOT))
    assert readers == []


TRITON_OFF = """
from common import switches
from decoder.kv_cache import KVCache
from decoder.model import Attention, Experts
from encoder import model, relpos_attention, resize
flags = [model.NORM_KERNEL, model.ACTIVATION_KERNEL, model.PATCH_KERNEL, resize.FUSED_PASS,
         relpos_attention.WINDOWS_IN_KERNEL, relpos_attention._triton() is not None]
print(flags, Attention.rope_kernel, Experts.kernel, switches.kernel("DEEPSEEK_OCR_PAGED_ATTENTION"))
"""


@pytest.mark.parametrize("triton, expected", [
    ("1", "[True, True, True, True, True, True] auto auto auto"),
    ("0", "[False, False, False, False, False, False] torch grouped_mm gather")])
def test_triton_off_turns_every_triton_kernel_off(triton, expected):
    """DEEPSEEK_OCR_TRITON=0 turns off every Triton kernel of the encoder and the decoder (their
    own switches left as they are): each falls back to its twin."""
    import subprocess
    import sys
    env = {**os.environ, "PYTHONPATH": ROOT, "DEEPSEEK_OCR_TRITON": triton}
    done = subprocess.run([sys.executable, "-c", TRITON_OFF], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == expected
