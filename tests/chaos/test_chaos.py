"""The chaos suite: K seeded random fault schedules over real `genrun` runs (see schedules.py),
each ending in the same output an undisturbed run produces, every trajectory exactly once; and
bad inputs, each refused in one line. Prints one summary line.

    GENRUN_CHAOS_SCHEDULES=8 .venv/bin/python -m pytest -q -s tests/chaos/test_chaos.py   # make chaos

Marked extended (CI time: ~5 minutes of 2 cores): make test runs each fault on its own instead
(a run quit at once, the state kill -9 leaves, then resumed: test_interrupt; a killed shard
worker: test_flow; a killed replica: test_replica_failover; a crash between a part and its
record: test_commit_records; a full disk: test_storage_faults; damaged parts:
test_part_integrity; a second run: test_lease; bad inputs: test_cli_errors). `make test-all`
runs one schedule (GENRUN_CHAOS_SCHEDULES defaults to 1; GENRUN_CHAOS_SEED picks the first
seed, by default one that holds every kind of fault: test_schedules.py), `make chaos` eight.

A schedule fails when one of its faults found no target, when the invocation with only
survivable faults did not finish, or when a second run on the busy folder was not refused. The
engine is `instant` with a delay per request: its tokens are a function of the prompt and the
sample's seed (generation.sample_seed), so the comparison with the reference is exact, the two
rollouts of a prompt differ (a rollout-number mix-up shows), and requests stay in flight long
enough to be killed.
"""

from __future__ import annotations

import os
import random
import re
import signal
from collections import Counter
from pathlib import Path

import pytest
import torch

from generation_core.outputs.padding import RUN_DEPENDENT_KEYS
from tests.chaos.schedules import InvocationDriver, Tally, damage_a_part, make_schedule
from tests.conftest import REPO, chat_rows, write_parquet
from tests.run_folder_helpers import committed_keys

SCHEDULES = int(os.environ.get("GENRUN_CHAOS_SCHEDULES", "1"))
# The seed of the one schedule make test-all runs: it holds every kind of fault (test_schedules.py), with
# its first damage landing on an unfinished shard (a same-size corruption of a finished shard
# would cost one more run).
CI_SEED = 3580
FIRST_SEED = int(os.environ.get("GENRUN_CHAOS_SEED", str(CI_SEED)))
BAD_INPUTS_PER_SCHEDULE = 3

pytestmark = [pytest.mark.slow, pytest.mark.chaos, pytest.mark.extended, pytest.mark.timeout(600 + 540 * SCHEDULES)]

PROMPTS, N, SHARDS = 24, 2, 2
EXPECTED = sorted(f"{i}:{n}" for i in range(PROMPTS) for n in range(N))
# The gate that holds the first run while a concurrent one starts (schedules.GATE_FROM).
GATED_LOOPS = REPO / "tests" / "chaos" / "agent_loops.yaml"


def _args(prompts: Path, out: Path, delay: float) -> list[str]:
    return [
        f"data.train_files={prompts}",
        f"trainer.default_local_dir={out}",
        "actor_rollout_ref.rollout.name=instant",
        f"actor_rollout_ref.rollout.engine_kwargs.instant.delay_seconds={delay}",
        f"actor_rollout_ref.rollout.n={N}",
        f"actor_rollout_ref.rollout.agent.agent_loop_config_path={GATED_LOOPS}",
        "actor_rollout_ref.rollout.agent.default_agent_loop=gated_agent",
        "generation.sample_seed=5",
        f"generation.num_shards={SHARDS}",
        "generation.max_inflight=2",
        "generation.save_batch_size=4",
        "generation.retries=3",
        "generation.retry_delay_seconds=1",
        "generation.request_backoff_seconds=0.5",
        "generation.show_progress=false",
    ]


def _reference(prompts: Path, out: Path):
    """The undisturbed run, in this process (delay 0: the tokens do not depend on it; no gate)."""
    from verl.protocol import DataProto

    from generation_core.driver.in_process import run_in_process
    from generation_core.preflight.preflight import preflight

    run_in_process(preflight(_args(prompts, out, 0.0)))
    return DataProto.load_from_disk(str(out / "trajectories.pkl"))


def _count(run_dir: Path, tally: Tally) -> list[str]:
    completed = committed_keys(run_dir)
    counts = Counter(completed)
    tally.expected += len(EXPECTED)
    tally.lost += len(set(EXPECTED) - set(counts))
    tally.duplicated += sum(c - 1 for c in counts.values() if c > 1) + len(set(counts) - set(EXPECTED))
    return completed


def _same_as_reference(run_dir: Path, reference) -> None:
    from verl.protocol import DataProto

    actual = DataProto.load_from_disk(str(run_dir / "trajectories.pkl"))
    assert len(actual) == len(reference) == len(EXPECTED)
    assert sorted(actual.batch.keys()) == sorted(reference.batch.keys())
    for key in reference.batch.keys():
        assert torch.equal(actual.batch[key], reference.batch[key]), key
    for key in reference.non_tensor_batch:
        if key not in RUN_DEPENDENT_KEYS:
            assert actual.non_tensor_batch[key].tolist() == reference.non_tensor_batch[key].tolist(), key


def _bad_inputs(tmp_path: Path, rng: random.Random, tally: Tally, capsys) -> None:
    from flows.cli import main
    from tests.bad_inputs import bad_input_cases, folder_contents, output_folder

    cases = bad_input_cases(tmp_path)
    for args, message in rng.sample(cases, min(BAD_INPUTS_PER_SCHEDULE, len(cases))):
        default = tmp_path / "bad-out"
        out = output_folder(args, default)
        before = folder_contents(out)
        code = main(args if out != default else [*args, f"trainer.default_local_dir={out}"])
        errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("genrun: error:")]
        tally.bad_inputs_tried += 1
        if code == 2 and len(errors) == 1 and re.search(message, errors[0]) and folder_contents(out) == before:
            tally.bad_inputs_refused += 1
        else:
            print(f"NOT REFUSED as expected: {args}: exit {code}, {errors}")


def test_seeded_fault_schedules_end_exactly_once(tmp_path, prefect_server, ray_local, model_dir, capsys):
    prompts = write_parquet(tmp_path / "prompts.parquet", chat_rows(PROMPTS))
    reference = _reference(prompts, tmp_path / "reference")
    responses = reference.batch["responses"]
    assert not any(torch.equal(responses[i * N], responses[i * N + 1]) for i in range(PROMPTS)), (
        "the rollouts of a prompt are identical: a rollout-number mix-up on resume would not show (generation.sample_seed)"
    )
    tally, problems = Tally(), []
    for seed in range(FIRST_SEED, FIRST_SEED + SCHEDULES):
        rng = random.Random(seed)
        workdir = tmp_path / f"seed-{seed}"
        run_dir = workdir / "run"
        driver = InvocationDriver(_args(prompts, run_dir, 0.6), prefect_server.env, workdir, rng)
        schedule = make_schedule(seed)
        print(f"seed {seed}: {schedule}")
        outcome, number, injected, damages = None, 0, 0, []
        for invocation in schedule:
            # A damage that finds no committed part yet waits for the next invocation.
            damages += [invocation.damage_before] if invocation.damage_before else []
            damaged: set[str] = set()
            for how in list(damages):
                path = damage_a_part(run_dir, how, rng, spare=damaged)
                if path:
                    damaged.add(path)
                    damages.remove(how)
                    tally.faults[how] += 1
                    injected += 1
            number += 1
            outcome = driver.run(number, invocation)
            tally.faults.update(outcome.injected)
            tally.missed += len(outcome.missed)
            injected += len(outcome.injected)
            tally.concurrent_refused += outcome.concurrent_refused
            print(
                f"seed {seed} invocation {number}: exit {outcome.returncode}, injected {outcome.injected}, missed {outcome.missed}"
            )
            if outcome.missed:
                problems.append(f"seed {seed} invocation {number}: faults that found no target: {outcome.missed}")
            if outcome.concurrent_not_refused:
                problems.append(
                    f"seed {seed}: a second run on the same folder was not refused (see {workdir}/concurrent-not-refused.log)"
                )
            if invocation.must_survive and outcome.returncode != 0:
                last = (outcome.stderr.strip().splitlines() or [""])[-1][:600]
                problems.append(
                    f"seed {seed} invocation {number}: the run did not survive {outcome.injected} (exit {outcome.returncode}): {last}"
                )
            if {"kill_run", "kill_run_after_part_write"} & set(outcome.injected):
                assert outcome.returncode == -signal.SIGKILL, (
                    f"seed {seed}: the run was to be killed -9, it exited {outcome.returncode}"
                )
        if damages:
            problems.append(f"seed {seed}: damages that found no committed part: {damages}")
        # The same command again until it succeeds: one more run at most when a same-size
        # corruption of a finished shard could only be found by the merge.
        for _ in range(2):
            if outcome.returncode == 0:
                break
            number += 1
            outcome = driver.run(number, type(schedule[-1])())
        tally.schedules += 1
        tally.invocations += number
        assert outcome.returncode == 0, f"seed {seed}: the last rerun failed:\n{outcome.stderr[-3000:]}"
        assert injected >= 1, f"seed {seed}: no fault was injected"
        _count(run_dir, tally)
        _same_as_reference(run_dir, reference)
        _bad_inputs(workdir, rng, tally, capsys)
    with capsys.disabled():
        print("\n" + tally.line())
    assert tally.lost == 0 and tally.duplicated == 0, tally.line()
    assert tally.bad_inputs_refused == tally.bad_inputs_tried, tally.line()
    assert not problems, "\n".join(problems)
