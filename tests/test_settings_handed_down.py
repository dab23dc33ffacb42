"""The run's settings are decided once, on the driver, and handed down (issue 53 item 2): the plan
carries them decided (max_inflight and the deadlines filled in) through its JSON, run.json records
them, and a shard job takes them from its plan: `GenerationSettings.of` was called three times
inside one shard job (the job's worker, the attempt, the adaptive rule), and max_inflight travelled
as null to be decided again on every worker."""

from __future__ import annotations

import dataclasses
import json

import pytest
from verl.utils import hf_tokenizer

import generation_core.config.settings as settings_module
from generation_core.config.loading import load_config
from generation_core.engines.instant import InstantEngine, InstantSettings
from generation_core.inputs.dataset_files import inspect_dataset
from generation_core.inputs.shard_rows import DatasetPrompts
from generation_core.run_plan import RunPlan, ShardSpec
from generation_core.shard.job import run_shard_job
from generation_core.shard.streaming import StreamingWorker
from tests.conftest import chat_rows, write_parquet
from tests.shard_runs import GivenWorker

pytestmark = pytest.mark.timeout(180)


def _refuse_deciding_again(monkeypatch) -> list[str]:
    """GenerationSettings.of, counted from now on."""
    calls: list[str] = []
    decide = settings_module.GenerationSettings.of.__func__  # type: ignore[attr-defined]

    def counted(cls, config):
        calls.append("of")
        return decide(cls, config)

    monkeypatch.setattr(settings_module.GenerationSettings, "of", classmethod(counted))
    return calls


def _plan(tmp_path, *overrides: str) -> RunPlan:
    rows = write_parquet(tmp_path / "rows.parquet", chat_rows(6))
    cfg = load_config(
        [
            f"data.train_files={rows}",
            f"trainer.default_local_dir={tmp_path / 'run'}",
            "actor_rollout_ref.rollout.name=instant",
            "actor_rollout_ref.rollout.max_num_seqs=8",
            "generation.show_progress=false",
            *overrides,
        ]
    )
    dataset = inspect_dataset(cfg).files
    return RunPlan(cfg, "f" * 64, [ShardSpec(0, 0, dataset.num_rows)], 2, dataset)


def test_the_plan_carries_the_decided_settings_and_run_json_records_them(tmp_path, monkeypatch):
    plan = _plan(tmp_path)
    assert plan.cfg.generation.max_inflight is None, "the config keeps what the user wrote"
    decided = (plan.settings.max_inflight, plan.settings.max_open_trajectories, plan.settings.request_timeout)
    assert decided == (16, 128, 600 + 2 * 128)
    text = plan.to_json()
    assert json.loads(text)["settings"] == dataclasses.asdict(plan.settings)
    calls = _refuse_deciding_again(monkeypatch)
    assert RunPlan.from_json(text).settings == plan.settings
    assert calls == [], "a worker parsing the plan decided the settings again"
    record = plan.run_record().to_json()
    assert (record["settings"]["max_inflight"], record["config"]["generation"]["max_inflight"]) == (16, None)


def test_a_shard_job_takes_its_settings_from_the_plan(tmp_path, monkeypatch, model_dir):
    """The attempt, its adaptive rule, its worker and reward scorer: none decides them again."""
    plan = _plan(tmp_path, "actor_rollout_ref.rollout.n=3")
    tokenizer = hf_tokenizer(str(model_dir))
    prompts = DatasetPrompts.for_shard(plan.cfg, plan.dataset, plan.shards[0], tokenizer)
    worker = StreamingWorker(
        plan.cfg, InstantEngine(InstantSettings(64, 16, tokenizer.eos_token_id)), settings=plan.settings
    )
    plan = RunPlan.from_json(plan.to_json())
    calls = _refuse_deciding_again(monkeypatch)
    try:
        marker = run_shard_job(plan, plan.shards[0], worker_factory=GivenWorker(prompts, worker))
    finally:
        worker.shutdown()
    assert marker.num_trajectories == 6 * 3
    assert calls == [], "the shard job decided the settings again"
