"""One inference engine each (the contract: base.py), and how an engine is served: a Ray actor (server.py), a verl replica (replicas.py), many requests per Ray call (request_batching.py)."""
