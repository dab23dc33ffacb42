"""The simulated engine (engine.py) and its verl replica (replica.py), outside the product.

`register()` serves it as `actor_rollout_ref.rollout.name=simulated` in this process, through
genrun's one hook for such engines (generation_core/engines/replicas.py `register_engine`); its
settings are `+actor_rollout_ref.rollout.engine_kwargs.simulated.<key>=...` (added keys: genrun's
own config does not list them), checked by the replica. The import stays here, in a function:
the replica's server actor imports engine.py, and through this package, and must not load verl
for it.
"""

from __future__ import annotations


def register() -> None:
    """`rollout.name=simulated` for runs planned and driven in this process."""
    from bench.sim.replica import SimulatedReplica
    from generation_core.engines.replicas import register_engine

    register_engine("simulated", SimulatedReplica)
