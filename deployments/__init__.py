"""Ray Serve deployments: thin wiring over encoder/, decoder/ and scheduler/."""

# Modules a Ray worker can import before it is given work (`RAY_preload_python_modules` in the
# environment of `ray start` or `serve run`): the workers Ray starts ahead then take a replica
# with torch and the app's modules already imported, so a new replica skips seconds of imports.
# cluster.yaml's GPU workers and the e2e bench set it.
PRELOAD_MODULES = "deployments.encoders,deployments.decoder_server,deployments.router"
