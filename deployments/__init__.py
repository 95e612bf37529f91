"""Ray Serve deployments: thin wiring over encoder/, decoder/ and scheduler/."""
