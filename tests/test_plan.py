"""The plan's one JSON shape (issue 32 item 2, issue 44 item 10): the whole RunPlan round-trips
through one JSON text (RunPlan.to_json / from_json); the flow hands that same text to every
Prefect task (run_shard, merge, publish) and each parses it once; the shard cache keys keep
their form, so a flow run finds the shards an earlier genrun cached."""

from __future__ import annotations

import hashlib
import inspect
import json
import types

import pytest
from omegaconf import OmegaConf

from generation_core.run_plan import DataFile, DatasetFiles, RunPlan, plan_shards

pytestmark = pytest.mark.timeout(60)


def _plan(folder: str) -> RunPlan:
    cfg = OmegaConf.create(
        {
            "trainer": {"default_local_dir": folder},
            "storage": {"options": {}},
            "actor_rollout_ref": {"rollout": {"n": 2}},
        }
    )
    dataset = DatasetFiles(
        (DataFile("/data/a.parquet", 10, 1234, "d" * 64), DataFile("/data/b.json", 5, 99, None, 10)), 15
    )
    return RunPlan(cfg, "a" * 64, plan_shards(15, 3), 2, dataset, model_digest="m" * 64)


def test_the_whole_plan_round_trips_through_its_json_text(tmp_path):
    """Issue 44 item 10: every field crosses, shards included (a shard task's plan used to arrive
    without them), and the text read back writes the same text."""
    plan = _plan(str(tmp_path / "run"))
    back = RunPlan.from_json(plan.to_json())
    assert (back.fingerprint, back.shards, back.pad_token_id, back.dataset, back.model_digest) == (
        plan.fingerprint,
        plan.shards,
        plan.pad_token_id,
        plan.dataset,
        plan.model_digest,
    )
    assert OmegaConf.to_container(back.cfg) == OmegaConf.to_container(plan.cfg)
    assert back.folder.display() == plan.folder.display()
    assert back.to_json() == plan.to_json()


def test_every_task_takes_the_plans_json_text():
    """Issue 44 item 10: run_shard took JSON text while merge and publish took RunPlan objects;
    the flow takes the CLI's text and passes it on as it came."""
    from flows.generate import generate
    from tasks.merge import merge
    from tasks.publish import publish
    from tasks.run_shard import run_shard

    annotations = {
        name: inspect.signature(fn).parameters["plan"].annotation
        for name, fn in (("run_shard", run_shard.fn), ("merge", merge.fn), ("publish", publish.fn))
    }
    assert annotations == {"run_shard": "str", "merge": "str", "publish": "str"}
    assert inspect.signature(generate.fn).parameters["plan"].annotation == "str | None"


def test_each_task_parses_the_plan_once(tmp_path, monkeypatch):
    """Issue 44 item 10: a shard task parsed the plan's text twice (its cache key, its body);
    now once per process for every shard task of a run, and merge hands finish_run the plan
    it read."""
    import tasks.merge
    import tasks.run_shard
    from tasks.run_shard import parsed_plan, run_shard, shard_cache_key

    folder = str(tmp_path / "run")
    text = _plan(folder).to_json()
    parsed_plan.cache_clear()
    jobs = []
    marker = types.SimpleNamespace(to_dict=lambda: {"shard": "done"})
    monkeypatch.setattr(tasks.run_shard, "run_shard_job", lambda plan, shard, **_: jobs.append((plan, shard)) or marker)
    keys = []
    for shard_id in range(3):
        parameters = {"plan": text, "shard": {"shard_id": shard_id, "start": 0, "end": 1}}
        keys.append(shard_cache_key(None, parameters))
        assert run_shard.fn(**parameters, registry_name="pool") == {"shard": "done"}
    # The form earlier genruns wrote: a resumed flow run finds their cached shards.
    assert keys == [
        f"genrun-{'a' * 24}-{hashlib.sha256(folder.encode()).hexdigest()[:16]}-shard-{shard_id:05d}"
        for shard_id in range(3)
    ]
    assert parsed_plan.cache_info().misses == 1
    assert [shard.shard_id for _, shard in jobs] == [0, 1, 2] and jobs[0][0].to_json() == text

    finished = []
    monkeypatch.setattr(tasks.merge, "finish_run", lambda plan, *rest: finished.append(plan) or {})
    tasks.merge.merge.fn(text, [], 1.0)
    assert [plan.to_json() for plan in finished] == [text]
    assert json.loads(text)["shards"] == [shard.to_dict() for shard in plan_shards(15, 3)]
