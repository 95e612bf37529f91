"""What every Ray worker of the app imports as it starts (`RAY_preload_python_modules` in the
app's start-up environment, deployments.STARTUP_ENVIRONMENT), so that a replica handed to a
worker Ray started ahead skips seconds of imports.

Ray starts a worker per core at once and hands one work only after its preload. Measured on an
H100 machine (16 cores, `e2e_bench --levels 4 --reps 2`): preloading the deployment modules
brought the replicas up ~10 s sooner, but Serve's controller and proxy, which run in such
workers too, waited ~3 s longer for them (cold start 24.7 / 22.7 s against 31.7 / 31.2 s without).

By default the deployment modules are imported here, before the worker takes work (the
reference twin). `DEEPSEEK_OCR_BACKGROUND_PRELOAD=1`: the Ray-free bulk of them (torch and the
model packages) is imported on a thread, and the worker takes work at once; a replica's
constructor importing one of those modules meanwhile waits for the thread's import of it
(Python's per-module import locks). Ray's modules are left to the main thread: two threads
importing one package's circular imports at once can fail with a deadlock error. Measured on the
same machine it started no faster (cold start 15.8 / 17.6 s against 20.3 / 14.7 s; with the
checkpoint prefetched 17.1 / 15.7 against 14.8 / 14.8), so it stays off.
"""
from __future__ import annotations

import importlib
import logging
import threading

from common import switches

log = logging.getLogger(__name__)

DEPLOYMENT_MODULES = ("deployments.encoders", "deployments.decoder_server", "deployments.router")
# No module here imports Ray (encoder/, decoder/, scheduler/, documents/ are plain Python and torch).
RAY_FREE_MODULES = ("torch", "encoder", "decoder", "scheduler", "documents")


def import_each(modules: tuple[str, ...]) -> None:
    """Best effort, as Ray's own preloading: a module that fails is logged here and raises
    again where a replica imports it."""
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - logged; the replica's own import reports it
            log.exception("preloading %s failed", name)


if switches.on("DEEPSEEK_OCR_BACKGROUND_PRELOAD"):
    thread: threading.Thread | None = threading.Thread(
        target=import_each, args=(RAY_FREE_MODULES,), name="preload", daemon=True)
    thread.start()
else:
    thread = None
    import_each(DEPLOYMENT_MODULES)
