"""Replicas in a pool and the requests sent to them: the pool, its registry, routing, batching, retries, joining Ray."""
