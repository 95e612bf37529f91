import gc
import os

import pytest
import torch
from hypothesis import settings

# CI draws the same examples every run (a red build must be reproducible); locally they vary,
# so property tests keep exploring.
settings.register_profile("ci", derandomize=True, deadline=None)
if os.environ.get("CI"):
    settings.load_profile("ci")

from encoder import EncoderArgs, load_encoder, write_random_checkpoint
from tests.helpers import free_port


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped elsewhere)")
    config.addinivalue_line("markers", "slow: takes tens of seconds on 2 CPU cores (CI runs them; "
                            "-m 'not slow' leaves them out)")


def pytest_collection_modifyitems(config, items):
    # The modules on the shared Serve app (`serve_app`) run last, together: the app starts once
    # for all of them, and no other test runs beside its idle cluster.
    on_app = {item.module.__name__ for item in items if "serve_app" in item.fixturenames}
    items.sort(key=lambda item: item.module.__name__ in on_app)  # stable: otherwise as collected
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="module")
def free_cuda_memory_after_each_module():
    """On a GPU, what a module's engines held goes back before the next module, as the GPU
    tests of every file run in one process (`pytest -m gpu`): without this,
    test_attention's dense formula (29 GB) met ~108 GB still held after earlier modules (an
    engine's graphs, streams and closures can keep it in reference cycles, which only a full
    collection frees; with it, the same run passed)."""
    yield
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()


@pytest.fixture(scope="session")
def tiny_args():
    return EncoderArgs.tiny()


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory, tiny_args):
    """A random checkpoint in the released layout at tiny dims, fp32 so comparisons are exact."""
    return write_random_checkpoint(tmp_path_factory.mktemp("tiny-ckpt"), tiny_args, seed=0,
                                   dtype=torch.float32)


@pytest.fixture(scope="session")
def tiny_encoder(tiny_checkpoint):
    return load_encoder(tiny_checkpoint)


def run_in_triton_interpreter(code: str, timeout: int = 600) -> str:
    """`code` in a fresh interpreter with Triton's CPU interpreter on (TRITON_INTERPRET is read
    at import, so it cannot be turned on in this process), from the repository root: its
    stdout; a non-zero exit fails the test with its stderr."""
    import subprocess
    import sys
    import tempfile
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=root)
    # From a file, not `-c`: triton.jit reads its kernel's source, so `code` may define kernels.
    with tempfile.NamedTemporaryFile("w", suffix=".py") as script:
        script.write(code)
        script.flush()
        run = subprocess.run([sys.executable, script.name], env=env, cwd=root, capture_output=True,
                             text=True, timeout=timeout)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout


SERVE_PORT = free_port()
SERVE_URL = f"http://127.0.0.1:{SERVE_PORT}"
METRICS_PORT = free_port()  # Ray's Prometheus export of this test cluster
SERVE_APP = "ocr-test"


@pytest.fixture(scope="session")
def serve_app():
    """The app (tiny model, CPU, max_len 2048, max_images 8, max_pages 400) on a real Ray
    cluster, started once for every module that uses it (they run last: see
    pytest_collection_modifyitems): a handle to its Router; HTTP on SERVE_URL. A module that
    deploys another app beside it deletes that app when done."""
    ray = pytest.importorskip("ray")
    from ray import serve

    from deployments.app import build
    from deployments.config import AppConfig
    if ray.is_initialized():  # started implicitly by an earlier module's in-process replica,
        ray.shutdown()        # without this cluster's metrics port
    ray.init(num_cpus=4, include_dashboard=False, _metrics_export_port=METRICS_PORT)
    serve.start(http_options={"host": "127.0.0.1", "port": SERVE_PORT})
    yield serve.run(build(AppConfig(max_len=2048, max_images=8, max_pages=400)), name=SERVE_APP, route_prefix="/")
    serve.shutdown()
    ray.shutdown()


def replica_ids() -> dict[str, str]:
    """Each deployment's replica id (one replica each): a replaced replica shows a new id."""
    from ray import serve
    return {name: serve.get_deployment_handle(name, SERVE_APP).stats.remote().result(timeout_s=60)["replica"]
            for name in ("Router", "GlobalEncoder", "LocalEncoder", "Decoder")}
