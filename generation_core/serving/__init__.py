"""Replicas in a pool and the requests sent to them: the pool, its registry and backends, shared loads and routing, retries, the turn log, joining Ray."""
