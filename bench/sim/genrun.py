"""`genrun`'s own command line with the simulated engine registered (from the repository root):

    .venv/bin/python -m bench.sim.genrun actor_rollout_ref.rollout.name=simulated \
        +actor_rollout_ref.rollout.engine_kwargs.simulated.time_scale=0.01 ...
"""

from __future__ import annotations

from bench.sim import register

if __name__ == "__main__":
    from flows.cli import run

    register()
    run()
