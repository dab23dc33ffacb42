"""Longest expected first (issue 34, item 5; inputs/length_hints.py): an earlier run's response
lengths order the shards and their rows; only the order changes, never what is generated."""

from __future__ import annotations

import json
import logging
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest

from generation_core.engines.simulated import SimulatedEngine, SimulatedSettings
from generation_core.errors import GenrunError
from generation_core.inputs.length_hints import LengthHints, rows_longest_first, shards_longest_first
from generation_core.run_plan import ShardSpec
from generation_core.store.folder import StorageFolder
from generation_core.store.part_repair import committed_parts, read_verified_part
from generation_core.store.trajectory_record import decode_provenance, read_part_table
from tests.conftest import REPO
from tests.longest_first_run import ENGINE, run_simulated

pytestmark = pytest.mark.timeout(300)

def test_expected_lengths_fall_back_to_the_mean_and_order_rows_and_shards_longest_first():
    hints = LengthHints(np.array([10, 11, 12, 13]), np.array([5.0, 50.0, 20.0, 5.0]))
    # 99 and 7 were not answered by the earlier run: the mean (20).
    assert hints.expected(np.array([11, 99, 13, 7])).tolist() == [50.0, 20.0, 5.0, 20.0]
    # Ties keep row order (rows 2 and 3 at 20; rows 0 and 4 at 5).
    assert rows_longest_first(np.array([10, 11, 12, 99, 13]), hints) == [1, 2, 3, 0, 4]
    shards = [ShardSpec(0, 0, 2), ShardSpec(1, 2, 4), ShardSpec(2, 4, 6)]
    rows = np.array([10, 13, 12, 99, 11, 10])  # longest per shard: 5, 20, 50; totals 10, 40, 55
    assert [s.shard_id for s in shards_longest_first(shards, rows, hints)] == [2, 1, 0]
    # Equal longest: the larger expected total first.
    rows = np.array([12, 10, 12, 99, 13, 10])
    assert [s.shard_id for s in shards_longest_first(shards, rows, hints)] == [1, 0, 2]


def test_the_hints_file_round_trips_and_a_shard_reads_only_its_index_range():
    indices = np.arange(0, 200_000, 2)
    hints = LengthHints(indices, indices / 2.0)
    again = LengthHints.from_parquet(hints.to_parquet())
    assert again.indices.tolist() == indices.tolist() and again.tokens.tolist() == (indices / 2.0).tolist()
    part = LengthHints.from_parquet(hints.to_parquet(), 1_000, 1_010)
    assert part.indices.tolist() == [1_000, 1_002, 1_004, 1_006, 1_008, 1_010]
    assert part.expected(np.array([1_004])).tolist() == [502.0]


def test_the_prompt_share_of_the_lengths_is_estimated_from_the_earlier_runs_samples():
    from generation_core.inputs.length_hints import prompt_share_of_lengths

    rng = np.random.default_rng(0)
    groups = np.repeat(np.arange(400), 8)
    for share in (0.0, 0.5, 0.8):
        prompt = rng.normal(size=400)[groups]
        lengths = np.exp(4.0 + np.sqrt(share) * prompt + np.sqrt(1 - share) * rng.normal(size=len(groups)))
        assert prompt_share_of_lengths(groups, lengths) == pytest.approx(share, abs=0.07)
    assert prompt_share_of_lengths(np.array([0, 1]), np.array([5.0, 9.0])) is None, "no prompt with two samples"
    assert prompt_share_of_lengths(np.zeros(4, dtype=np.int64), np.array([5.0, 9.0, 2.0, 3.0])) is None, "one prompt"


def test_the_simulated_prompt_share_makes_a_prompt_decide_its_samples_lengths():
    def lengths(share: float) -> list[int]:
        engine = SimulatedEngine(SimulatedSettings(prompt_length=64, response_length=4096, eos_token_id=2, response_tokens_median=64,
                                                   response_tokens_sigma=1.0, response_tokens_prompt_share=share))
        return [engine._length([5, 6, 7], _params(seed)) for seed in range(6)]

    assert len(set(lengths(1.0))) == 1, "the prompt decides the length: every sample of it alike"
    assert len(set(lengths(0.0))) == 6, "each sample its own draw"
    assert len(set(lengths(0.5))) == 6


def _params(seed: int):
    from generation_core.engines.base import SamplingParams

    return SamplingParams.from_request({"seed": seed, "temperature": 1.0})


def _starts(out) -> dict[int, float]:
    """Each sample index's first start (provenance started_at), from the committed parts."""
    folder = StorageFolder(str(out), {})
    starts: dict[int, float] = {}
    for part in committed_parts(folder):
        table = read_part_table(read_verified_part(folder, part), ["index", "provenance", *(f"seconds_{n}" for n in ("slot_wait", "prefill", "decode", "tools", "reward"))])
        provenance, _ = decode_provenance(table)
        for index, prov in zip(table.column("index").to_pylist(), provenance, strict=True):
            starts[index] = min(starts.get(index, float("inf")), prov["started_at"])
    return starts


def _lengths(out) -> dict[int, float]:
    with open(out / "trajectories.pkl", "rb") as f:
        data = pickle.load(f)
    tokens = data.batch["response_mask"].sum(-1).tolist()
    per: dict[int, list[int]] = {}
    for index, count in zip(data.non_tensor_batch["index"].tolist(), tokens, strict=True):
        per.setdefault(int(index), []).append(count)
    return {index: sum(v) / len(v) for index, v in per.items()}


def _trajectories(out) -> list[tuple]:
    with open(out / "trajectories.pkl", "rb") as f:
        data = pickle.load(f)
    return sorted(zip(data.non_tensor_batch["index"].tolist(), data.batch["responses"].tolist(), strict=True))


def test_a_run_dispatches_shards_and_rows_longest_first_from_an_earlier_run_and_generates_the_same(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="generation_core.inputs.length_hints")
    run_simulated(tmp_path / "last_night", "generation.sample_seed=1")
    earlier = _lengths(tmp_path / "last_night")
    assert len(set(earlier.values())) > 4, "the earlier run's prompts differ in length"

    plan, summary = run_simulated(tmp_path / "tonight", "generation.sample_seed=2", f"generation.longest_first_from={tmp_path / 'last_night'}", as_json=True)
    # The simulator's prompts decide their whole length here, and the log says so.
    assert "the prompt decides 100% of their log-variance" in caplog.text
    plain_plan, plain = run_simulated(tmp_path / "plain", "generation.sample_seed=2")
    assert summary["num_trajectories"] == plain["num_trajectories"] == 32

    # Shards by their longest expected prompt (shard i holds rows 4i..4i+3, index = row).
    longest = {s.shard_id: max(earlier[i] for i in range(s.start, s.end)) for s in plain_plan.shards}
    assert [s.shard_id for s in plan.shards] == sorted(longest, key=lambda k: (-longest[k], k))
    assert [s.shard_id for s in plain_plan.shards] == [0, 1, 2, 3]
    # One call in flight: within the run, prompts started in that order, each shard's longest first.
    starts = _starts(tmp_path / "tonight")
    started = sorted(starts, key=starts.get)
    expected = [i for s in plan.shards for i in sorted(range(s.start, s.end), key=lambda i: (-earlier[i], i))]
    assert started == expected
    assert sorted(_starts(tmp_path / "plain"), key=_starts(tmp_path / "plain").get) == list(range(16))

    # Only the order changed: the same trajectories, the same run.json shards (by id), the hints kept.
    assert _trajectories(tmp_path / "tonight") == _trajectories(tmp_path / "plain")
    shards_json = [json.loads((tmp_path / name / "run.json").read_text())["shards"] for name in ("tonight", "plain")]
    assert shards_json[0] == shards_json[1]
    assert (tmp_path / "tonight" / "length_hints.parquet").exists()
    # manifest.json says where the order came from and how much of a length the prompt decided there.
    recorded = json.loads((tmp_path / "tonight" / "manifest.json").read_text())["longest_first"]
    assert recorded["from"] == str(tmp_path / "last_night") and recorded["prompts"] == 16 and recorded["prompt_share"] == 1.0
    assert summary["longest_first"] == recorded and "longest_first" not in plain
    assert not (tmp_path / "plain" / "length_hints.parquet").exists()


def test_an_earlier_run_folder_without_trajectories_is_refused_before_any_work(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "run.json").write_text(json.dumps({"fingerprint": "f" * 64}))
    with pytest.raises(GenrunError, match=r"generation.longest_first_from=.*no committed trajectories there"):
        run_simulated(tmp_path / "out", f"generation.longest_first_from={tmp_path / 'empty'}")
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_a_longest_first_run_killed_and_resumed_generates_what_an_uninterrupted_one_does(tmp_path):
    run_simulated(tmp_path / "last_night", "generation.sample_seed=1")
    extra = ["generation.sample_seed=2", f"generation.longest_first_from={tmp_path / 'last_night'}", "generation.save_batch_size=4"]
    run_simulated(tmp_path / "whole", *extra)
    # kill -9 after the third part is written, then the same command resumes.
    env = {**os.environ, "PYTHONPATH": str(REPO), "GENRUN_FAILPOINTS": "after_part_write@3:kill"}
    killed = subprocess.run([sys.executable, "-m", "tests.longest_first_run", str(tmp_path / "killed"), *extra], env=env, cwd=REPO, capture_output=True, timeout=240)
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert 0 < len(_starts(tmp_path / "killed")) < 16, "the kill left part of the run committed"
    _, resumed = run_simulated(tmp_path / "killed", *extra)
    assert resumed["num_trajectories"] == 32
    assert _trajectories(tmp_path / "killed") == _trajectories(tmp_path / "whole")


def test_a_parent_folder_gives_the_newest_earlier_run_over_the_same_prompts(tmp_path, caplog):
    """A nightly schedule names the folder its runs go under: the newest run there over the same
    prompts is read; a newer run over other prompts, and this run's own folder, are not."""
    from tests.conftest import write_parquet

    caplog.set_level(logging.INFO, logger="generation_core.inputs.length_hints")
    runs = tmp_path / "runs"
    run_simulated(runs / "older", "generation.sample_seed=1")
    run_simulated(runs / "newest", "generation.sample_seed=3")
    other = write_parquet(tmp_path / "other.parquet", [
        {"data_source": "t", "prompt": [{"role": "user", "content": f"Another question {i}?"}], "ability": "t",
         "reward_model": {"style": "rule", "ground_truth": "x"}, "extra_info": {"index": i}} for i in range(16)
    ])
    run_simulated(runs / "other_prompts", "generation.sample_seed=1", f"data.train_files={other}")
    for name, created in (("older", "2026-11-01T00:00:00Z"), ("newest", "2026-11-02T00:00:00Z"), ("other_prompts", "2026-11-03T00:00:00Z")):
        record = json.loads((runs / name / "run.json").read_text())
        (runs / name / "run.json").write_text(json.dumps(dict(record, created=created)))

    # A newer run over the same prompts that failed before its first commit says nothing.
    (runs / "crashed").mkdir()
    record = json.loads((runs / "newest" / "run.json").read_text())
    (runs / "crashed" / "run.json").write_text(json.dumps(dict(record, created="2026-11-04T00:00:00Z")))

    run_simulated(runs / "tonight", "generation.sample_seed=2", f"generation.longest_first_from={runs}")
    assert f"{runs / 'newest'} is the newest earlier run over the same prompts under {runs}" in caplog.text
    # Its resume finds its own folder there now, and still reads the same earlier run.
    caplog.clear()
    run_simulated(runs / "tonight", "generation.sample_seed=2", f"generation.longest_first_from={runs}")
    assert f"{runs / 'newest'} is the newest earlier run" in caplog.text

    # A schedule's first night: no earlier run over its prompts there yet, so the dataset's order.
    caplog.clear()
    (tmp_path / "empty_runs").mkdir()
    plan, summary = run_simulated(tmp_path / "first_night", f"data.train_files={other}", "generation.sample_seed=1", f"generation.longest_first_from={tmp_path / 'empty_runs'}")
    assert summary["num_trajectories"] == 32 and [s.shard_id for s in plan.shards] == [0, 1, 2, 3]
    assert "holds no earlier run over the same prompts" in caplog.text
    assert not (tmp_path / "first_night" / "length_hints.parquet").exists()
    with pytest.raises(GenrunError, match=r"generation.longest_first_from=.*nothing_here: no such folder"):
        run_simulated(tmp_path / "elsewhere", f"generation.longest_first_from={tmp_path / 'nothing_here'}")


def test_lengths_the_prompt_hardly_decides_leave_the_dataset_order_with_a_warning(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="generation_core.inputs.length_hints")
    noise = (f"{ENGINE}.response_tokens_prompt_share=0.0", "actor_rollout_ref.rollout.n=8")
    run_simulated(tmp_path / "last_night", "generation.sample_seed=1", *noise)
    # An earlier invocation's figures (taken from another run then) must not order tonight's shards.
    (tmp_path / "tonight").mkdir()
    (tmp_path / "tonight" / "length_hints.parquet").write_bytes(LengthHints(np.arange(16), np.arange(16.0)).to_parquet())
    plan, summary = run_simulated(tmp_path / "tonight", "generation.sample_seed=2", *noise, f"generation.longest_first_from={tmp_path / 'last_night'}")
    assert "an order by them is noise, so this run keeps the dataset's order" in caplog.text
    assert [s.shard_id for s in plan.shards] == [0, 1, 2, 3] and summary["num_trajectories"] == 128
    assert "longest_first" not in summary and not (tmp_path / "tonight" / "length_hints.parquet").exists()
