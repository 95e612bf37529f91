"""cluster.yaml against Ray's own schema; the Serve configs against Serve's schema; builder args."""
import copy
import json
import os

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
    assert config["available_node_types"]["head"]["resources"] == {"CPU": 0}  # no replicas on head
    worker = config["available_node_types"]["gpu_worker"]
    assert 1 <= worker["min_workers"] <= worker["max_workers"]
    assert any("pip install" in c and "deepseek-ocr-serve" in c for c in config["setup_commands"])


def test_schema_check_can_fail(cluster_schema):
    config = load(os.path.join(ROOT, "cluster.yaml"))
    broken = copy.deepcopy(config)
    del broken["provider"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, cluster_schema)


def serve_configs():
    out = {name: load(os.path.join(CONFIGS, f"{name}.yaml"))
           for name in ("cpu-tiny", "gpu-shared", "gpu-separate")}
    out["kuberay"] = yaml.safe_load(load(os.path.join(CONFIGS, "kuberay-rayservice.yaml"))["spec"]["serveConfigV2"])
    return out


@pytest.mark.parametrize("name", ["cpu-tiny", "gpu-shared", "gpu-separate", "kuberay"])
def test_serve_configs_validate(name):
    config = serve_configs()[name]
    ServeDeploySchema.model_validate(config)
    (app,) = config["applications"]
    assert app["import_path"] == "deployments.app:build"
    names = {d["name"] for d in app["deployments"]}
    assert names == {"Router", "GlobalEncoder", "LocalEncoder", "Decoder"}
    if name != "cpu-tiny":
        for d in app["deployments"]:  # every tier autoscales, target below max_ongoing_requests
            auto = d["autoscaling_config"]
            assert auto["target_ongoing_requests"] < d["max_ongoing_requests"]
            assert 1 <= auto["min_replicas"] <= auto["max_replicas"]
    from deployments.app import build
    build({k: str(v) for k, v in app.get("args", {}).items()})  # the builder takes these args


def test_gpu_shared_fits_one_gpu():
    (app,) = serve_configs()["gpu-shared"]["applications"]
    gpus = sum(d["ray_actor_options"].get("num_gpus", 0) for d in app["deployments"])
    assert gpus == pytest.approx(1.0)
    fractions = [v for k, v in app["args"].items() if k.startswith("gpu_memory_fraction")]
    assert len(fractions) == 3 and sum(fractions) <= 0.95


def test_builder_rejects_unknown_args():
    from deployments.app import build
    with pytest.raises(ValueError, match="unknown app arguments"):
        build({"chekpoint": "/x"})
