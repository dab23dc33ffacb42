"""A small run on the simulated engine, in this process (tests/test_longest_first.py runs it here
and in a subprocess, to kill it with a failpoint). Usage: python -m tests.longest_first_run OUT [key=value ...]"""

from __future__ import annotations

import sys

ENGINE = "actor_rollout_ref.rollout.engine_kwargs.simulated"


def run_simulated(out, *extra: str, as_json: bool = False):
    """A run on the simulated engine, in process; `as_json`: its plan through to_dict/from_dict
    first, as genrun hands it to the Prefect flow."""
    from generation_core.driver.in_process import run_in_process
    from generation_core.plan.preflight import preflight
    from generation_core.run_plan import RunPlan

    plan = preflight([
        f"trainer.default_local_dir={out}", "actor_rollout_ref.rollout.name=simulated", "actor_rollout_ref.rollout.n=2",
        "generation.num_shards=4", "generation.show_progress=false", "data.train_max_samples=16", "generation.max_inflight=1",
        "generation.max_open_trajectories=1", f"{ENGINE}.time_scale=0.001", f"{ENGINE}.response_tokens_sigma=1.0",
        f"{ENGINE}.response_tokens_median=16", f"{ENGINE}.response_tokens_prompt_share=1.0", *extra,
    ])
    summary = run_in_process(RunPlan.from_dict(plan.to_dict()) if as_json else plan)
    return plan, summary


if __name__ == "__main__":
    run_simulated(sys.argv[1], *sys.argv[2:])
