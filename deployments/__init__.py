"""Ray Serve deployments: thin wiring over encoder/, decoder/ and scheduler/."""

# The module a Ray worker imports before it is given work (`RAY_preload_python_modules` in the
# environment of `ray start` or `serve run`): the workers Ray starts ahead then take a replica
# with torch and the app's modules already imported, so a new replica skips seconds of imports
# (deployments/preload.py: which modules, and how).
PRELOAD_MODULES = "deployments.preload"

# The environment a Ray cluster running the app starts with (its processes inherit it; it
# cannot be set later, per application): preloaded modules, and the middleware through which
# Serve's proxy answers /health and /ready while no Router replica is up yet
# (deployments/probes.py). `serve run deployments.app:...` and `deepseek-ocr serve` set it
# (deployments/__main__.py); cluster.yaml's `ray start` commands carry it.
STARTUP_ENVIRONMENT = {
    "RAY_preload_python_modules": PRELOAD_MODULES,
    "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH": "deployments.probes:proxy_middlewares",
}
