"""How the parts start: the local Prefect API, the work pool, Ray, the bundled model."""
