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

# The clusters the tests start run in this environment (the suite is CPU-bound; starts as users
# start the app, test_app_cli's and the e2e bench's, leave RAY_ variables out):
# - no worker preload (deployments/preload.py, which `import deployments.app` sets before Ray
#   starts): it saves a replica its imports' latency, not their CPU, and every other worker
#   (Serve's controller and proxy, Ray Data's helper actors and tasks, workers left idle) pays
#   ~2-3 s of CPU for it: the offline command's test took 124 CPU-s with it, 104 without;
# - Serve's replicas and its handles' routers (the proxy's, a Router's) hand their cached
#   metrics to Ray each second, not every 100 ms, busy or idle (Ray reports them every few
#   seconds anyway): an idle app and its cluster took 2.9 CPU-s in 20 s, not 3.5.
TEST_CLUSTER_ENVIRONMENT = {"RAY_preload_python_modules": "", "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000"}
os.environ.update(TEST_CLUSTER_ENVIRONMENT)

from encoder import EncoderArgs, load_encoder, write_random_checkpoint
from tests.helpers import free_port


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped elsewhere)")
    config.addinivalue_line("markers", "slow: takes tens of seconds on 2 CPU cores (CI runs them; "
                            "-m 'not slow' leaves them out)")


# -- the suite on several worker processes (pytest-xdist; pyproject's addopts: `-n auto`) ------
# Much of the suite's wall time is waiting (Ray clusters and apps starting, servers in other
# processes, load steps): a second worker overlaps those waits with work. A unit of work keeps
# its module-scoped fixtures on one worker: a module; the modules on the shared app, in two
# units (each worker that runs one starts its own app: one unit was ~800 of the suite's ~1000 s
# of wall, longer than the rest of a worker's share); one test, in modules whose tests share
# nothing (each starts its own cluster); and the tests whose timing is their subject
# (autoscaling, node loss, rolling updates, probes answered at once), one after the other,
# never two of their clusters at once. Units go out longest first (SECONDS_ALONE: alone on 2
# cores, 2026-12-07; unlisted ones are short), so no long one starts last. (`UnitScheduling`
# hands them out: xdist's own `--dist loadgroup` cannot group under pytest 9, whose node ids it
# can no longer suffix.)
WORKERS = 2  # 2 cores: more workers only slowed each other's clusters (docs/tests.md)
ON_THE_SHARED_APP = {  # the modules using `serve_app` (checked at collection): their unit
    **dict.fromkeys(("tests.test_offline", "tests.test_admission", "tests.test_documents_api",
                     "tests.test_openai_api"), "on-the-shared-app-a"),
    **dict.fromkeys(("tests.test_serve", "tests.test_batches_api", "tests.test_models", "tests.test_operations",
                     "tests.test_bad_inputs"), "on-the-shared-app-b")}
ONE_UNIT_PER_TEST = ("tests.test_bench_scripts",)
TIMED_CLUSTERS = "timed-clusters"
IN_TIMED_CLUSTERS = ("tests.test_autoscaling_cluster", "tests.test_cluster_operations", "tests.test_app_cli",
                     "tests/test_bench_scripts.py::test_scaleout_bench_smoke")
SECONDS_ALONE = {
    # the shared app's two units: its 360 s alone split as their modules' shares of a run
    TIMED_CLUSTERS: 350, "on-the-shared-app-a": 165, "on-the-shared-app-b": 195,
    "tests/test_bench_scripts.py::test_e2e_bench_smoke": 56,
    "tests/test_bench_scripts.py::test_serve_bench_smoke": 45, "tests.test_attention": 44,
    "tests/test_bench_scripts.py::test_batch_bench_smoke": 23,
    "tests.test_unlimited_ocr_decoder": 44, "tests.test_engine": 40, "tests.test_graphs": 36,
    "tests.test_decoder_model": 20, "tests.test_offline_cluster": 35}


def unit_of(nodeid: str) -> str:
    """The unit of work a test belongs to, from its node id (all the scheduler has)."""
    path, _, name = nodeid.partition("::")
    module, test = path.removesuffix(".py").replace("/", "."), f"{path}::{name.split('[')[0]}"
    if module in ON_THE_SHARED_APP:
        return ON_THE_SHARED_APP[module]
    if module in IN_TIMED_CLUSTERS or test in IN_TIMED_CLUSTERS:
        return TIMED_CLUSTERS
    return test if module in ONE_UNIT_PER_TEST else module


if os.environ.get("PYTEST_XDIST_WORKER") and not torch.cuda.is_available():
    # One thread per worker process, and for what it starts (Ray's workers already take one):
    # the workers fill the cores between them, and a second thread per process only spins in
    # OpenMP's wait against the other worker (test_attention + test_unlimited_ocr_decoder alone:
    # 106 CPU-seconds on two threads, 91 on one).
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


def pytest_xdist_auto_num_workers(config):
    """`-n auto`: WORKERS on CPUs; none with a GPU (its tests would share one card's memory)."""
    return 0 if torch.cuda.is_available() else WORKERS


def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class UnitScheduling(LoadScopeScheduling):
        """xdist's scope scheduling (a scope's tests on one worker, in order; scopes handed out
        in the order of their first test), with `unit_of` as the scope."""

        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)
    return UnitScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    on_app = {item.module.__name__ for item in items if "serve_app" in item.fixturenames}
    missing = on_app - set(ON_THE_SHARED_APP)
    assert not missing, f"add {missing} to ON_THE_SHARED_APP (a unit of the modules on the shared app)"
    items.sort(key=lambda item: -SECONDS_ALONE.get(unit_of(item.nodeid), 0))  # stable: otherwise as collected
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


class SharedApp:
    """The app the modules on the shared app use, in this process: started by the first of
    their tests, stopped after the last of them (`pytest_runtest_teardown`), so its cluster
    does not idle beside the units a worker runs next; started again should more come."""

    def __init__(self):
        self.handle = None
        self.batch_jobs = None  # its batch store's folder (~15 MB after the suite), removed at stop

    def start(self):
        if self.handle is None:
            ray = pytest.importorskip("ray")
            from ray import serve

            from deployments.app import build
            from deployments.config import AppConfig
            if ray.is_initialized():  # started earlier in this worker by another module,
                ray.shutdown()        # without this cluster's metrics port
            ray.init(num_cpus=4, include_dashboard=False, _metrics_export_port=METRICS_PORT)
            serve.start(http_options={"host": "127.0.0.1", "port": SERVE_PORT})
            import tempfile
            self.batch_jobs = tempfile.mkdtemp(prefix="batch-jobs-")  # this suite's own batch store
            self.handle = serve.run(build(AppConfig(max_len=2048, max_images=8, max_pages=400,
                                                    batch_store=f"{self.batch_jobs}/batches.db",
                                                    batch_files=f"{self.batch_jobs}/files", batch_file_mb=16)),
                                    name=SERVE_APP, route_prefix="/")
        return self.handle

    def stop(self):
        if self.handle is not None:
            import ray
            from ray import serve
            self.handle = None
            serve.shutdown()
            ray.shutdown()
            import shutil
            shutil.rmtree(self.batch_jobs, ignore_errors=True)


SHARED_APP = SharedApp()


@pytest.fixture(scope="module")
def serve_app():
    """The app (tiny model, CPU, max_len 2048, max_images 8, max_pages 400) on a real Ray
    cluster, started once in a worker for the modules that use it (two units of work: each
    unit's modules run together, see `unit_of`): a handle to its Router; HTTP on SERVE_URL. A
    module that deploys another app beside it deletes that app when done."""
    return SHARED_APP.start()


def shared_tier(name: str):
    """A handle to one of the shared app's deployments (`GlobalEncoder`, `LocalEncoder`,
    `Decoder`, `Router`), for apps that run over them."""
    from ray import serve
    return serve.get_deployment_handle(name, SERVE_APP)


def routers_over_the_shared_tiers(name: str, config, routers: int = 1, own_decoder: bool = False) -> str:
    """An app beside the shared one of `routers` Router replicas with `config`, over the shared
    app's tiers where `config` has them as it does: its two path encoders (an app of one
    Encoder, or of the encoder in its Routers, starts its own as `build` binds them), and its
    Decoder unless `own_decoder` (a Decoder of `config`'s) or `config` is encode-only. Only
    those replicas start (each ~3 CPU-s of imports; the suite is CPU-bound). Its URL; the caller
    deletes it (`serve.delete(name)`)."""
    from ray import serve

    from deployments.app import model_tiers
    from deployments.placement import ModelTiers
    from deployments.router import Router
    (model,) = config.served_models()
    built = model_tiers(model)
    two_paths = not (config.one_encoder or config.encoder_in_router)
    encoders = (shared_tier("GlobalEncoder"), shared_tier("LocalEncoder")) if two_paths else (
        built.global_encoder, built.local_encoder)
    decoder = built.decoder if own_decoder or config.encode_only else shared_tier("Decoder")
    serve.run(Router.options(num_replicas=routers).bind([ModelTiers(model, *encoders, decoder)], config),
              name=name, route_prefix=f"/{name}")
    return f"{SERVE_URL}/{name}"


@pytest.hookimpl(trylast=True)  # after the finished test's fixtures (apps deployed beside it) went
def pytest_runtest_teardown(item, nextitem):
    on_app = ON_THE_SHARED_APP
    if item.module.__name__ in on_app and (nextitem is None or nextitem.module.__name__ not in on_app):
        SHARED_APP.stop()  # the worker's next unit runs without its cluster beside it


def replica_ids() -> dict[str, str]:
    """Each deployment's replica id (one replica each): a replaced replica shows a new id."""
    return {name: shared_tier(name).stats.remote().result(timeout_s=60)["replica"]
            for name in ("Router", "GlobalEncoder", "LocalEncoder", "Decoder")}
