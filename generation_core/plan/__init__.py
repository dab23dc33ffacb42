"""The run's plan: its light vocabulary (RunPlan, ShardSpec), the fingerprint, and the preflight that builds it."""
