"""The simulated engine (engine.py) and its verl replica (replica.py), outside the product:
`register()` serves it as `rollout.name=simulated` through genrun's `register_engine` hook, its
settings `+actor_rollout_ref.rollout.engine_kwargs.simulated.<key>=...`. The replica is imported in
the function: the server actor imports engine.py, through this package, and must not load verl.
"""

from __future__ import annotations


def register() -> None:
    """`rollout.name=simulated` for runs planned and driven in this process."""
    from bench.sim.replica import SimulatedReplica
    from generation_core.engines.replicas import register_engine

    register_engine("simulated", SimulatedReplica)
