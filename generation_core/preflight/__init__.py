"""Preflight: every check that needs no model, the run fingerprint, and the plan they build, once per command."""
