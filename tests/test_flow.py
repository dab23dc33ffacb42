"""The Prefect flow on a real Prefect server and a real local Ray cluster: sharded runs,
task retries that resume from the checkpoint, failed shards, the UI's retry of a failed flow
run, and the repo's prefect.yaml deployed and run through a process worker."""

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from verl.protocol import DataProto

from generation_core.dispatch import run_in_process
from generation_core.preflight import preflight
from tests.conftest import REPO, chat_rows, kill_group, run_genrun, write_parquet

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

AGENT_LOOPS = REPO / "tests" / "agent_loops.yaml"
PREFECT = str(Path(sys.executable).parent / "prefect")


def _instant(prompts, out, *extra):
    return [
        f"data.train_files={prompts}",
        f"trainer.default_local_dir={out}",
        "actor_rollout_ref.rollout.name=instant",
        "actor_rollout_ref.rollout.calculate_log_probs=true",
        "generation.show_progress=false",
        "generation.save_batch_size=2",
        *extra,
    ]


def _assert_same_dataproto(actual: DataProto, expected: DataProto):
    assert sorted(actual.batch.keys()) == sorted(expected.batch.keys())
    for key in expected.batch.keys():
        assert torch.equal(actual.batch[key], expected.batch[key]), key
    assert sorted(actual.non_tensor_batch) == sorted(expected.non_tensor_batch)
    for key in expected.non_tensor_batch:
        assert actual.non_tensor_batch[key].tolist() == expected.non_tensor_batch[key].tolist(), key


def _task_states(server, flow_run_id, settle_seconds: float = 60.0):
    """The shard task runs' state names, once none is still Running/Pending: a task on a Ray
    worker reports its final state on its own, and that report can reach the API a moment after
    the flow run's own final state."""
    deadline = time.monotonic() + settle_seconds
    while True:
        runs = server.api("POST", "/task_runs/filter", json={"flow_runs": {"id": {"any_": [flow_run_id]}}})
        states = [r["state"]["name"] for r in runs if r["name"].startswith("shard-")]
        if not {"Running", "Pending"} & set(states) or time.monotonic() > deadline:
            return states
        time.sleep(0.5)


# CI time: in make test the chaos schedule runs the flow (2 shards on Ray) and compares it with an
# undisturbed run, and the UI-retry test below runs 3 shards through a deployment.
@pytest.mark.extended
def test_three_shards_on_ray_equal_the_in_process_run(prefect_server, ray_local, tmp_path):
    prompts = write_parquet(tmp_path / "prompts.parquet", chat_rows(10))
    result = run_genrun([*_instant(prompts, tmp_path / "flow"), "generation.num_shards=3"], env=prefect_server.env)
    assert result.returncode == 0, result.stderr[-3000:]
    in_process = run_in_process(preflight([*_instant(prompts, tmp_path / "plain"), "generation.num_shards=3"]))
    assert in_process["num_trajectories"] == 10
    _assert_same_dataproto(DataProto.load_from_disk(str(tmp_path / "flow" / "trajectories.pkl")), DataProto.load_from_disk(str(tmp_path / "plain" / "trajectories.pkl")))

    (flow_run,) = prefect_server.api("POST", "/flow_runs/filter", json={})
    assert flow_run["state"]["type"] == "COMPLETED"
    assert sorted(_task_states(prefect_server, flow_run["id"])) == ["Completed"] * 3
    artifacts = {a["key"]: a for a in prefect_server.api("POST", "/artifacts/filter", json={"artifacts": {"flow_run_id": {"any_": [flow_run["id"]]}}})}
    progress = next(a for k, a in artifacts.items() if k.endswith("-progress"))
    assert progress["data"] == 100.0
    table = next(a for k, a in artifacts.items() if k.endswith("-shards"))
    rows = json.loads(table["data"])
    assert sorted(r["shard"] for r in rows) == ["shard-00000", "shard-00001", "shard-00002"]
    assert sum(r["samples"] for r in rows) == 10
    assert any(k.endswith("-output") for k in artifacts)


def test_a_shard_failing_once_is_retried_and_resumes_from_its_checkpoint(prefect_server, tmp_path):
    prompts = write_parquet(tmp_path / "prompts.parquet", chat_rows(8))
    flag = tmp_path / "fail-once"
    flag.write_text("")
    trace = tmp_path / "samples.trace"
    env = dict(prefect_server.env, GENRUN_TEST_FAIL_FLAG=str(flag), GENRUN_TEST_FAIL_INDEX="5", GENRUN_TEST_FAIL_MODE="once", GENRUN_SAMPLE_TRACE=str(trace))
    args = _instant(
        prompts, tmp_path / "run",
        "generation.max_inflight=2", "generation.retries=1", "generation.retry_delay_seconds=0",
        f"actor_rollout_ref.rollout.agent.agent_loop_config_path={AGENT_LOOPS}", "actor_rollout_ref.rollout.agent.default_agent_loop=flaky_agent",
    )
    result = run_genrun(args, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    # The CLI's preflight plans the run and hands the plan to the flow: verl's dataset (and its
    # overlong filter) is loaded once in the driver, not again by the flow.
    assert (result.stdout + result.stderr).count("filter dataset len") == 1, result.stdout[-3000:]
    assert not flag.exists(), "the injected failure happened"
    marker = json.loads((tmp_path / "run" / "shards" / "shard-00000" / "_SUCCESS.json").read_text())
    assert marker["attempts"] == 2 and marker["num_trajectories"] == 8
    finished = re.findall(r"finished (\d+:\d+)", trace.read_text())
    # Samples committed before the failure were not generated again by the retry.
    assert finished.count("0:0") == 1 and finished.count("1:0") == 1
    assert len(finished) <= 8 + 2, "at most max_inflight samples regenerated"
    data = DataProto.load_from_disk(str(tmp_path / "run" / "trajectories.pkl"))
    assert data.non_tensor_batch["index"].tolist() == list(range(8))


@pytest.fixture(scope="module")
def deployed(prefect_server, tmp_path_factory):
    """prefect.yaml deployed against the test server, and a process worker serving the pool."""
    work = tmp_path_factory.mktemp("deployed")
    env = dict(prefect_server.env, GENRUN_TEST_FAIL_FLAG=str(work / "fail-always"), GENRUN_TEST_FAIL_INDEX="4", GENRUN_SAMPLE_TRACE=str(work / "samples.trace"))
    subprocess.run(["bash", "infra/create_pool.sh"], cwd=REPO, env=env, check=True, timeout=120, capture_output=True)
    deploy = subprocess.run([PREFECT, "--no-prompt", "deploy", "--all"], cwd=REPO, env=env, timeout=300, capture_output=True, text=True)
    assert deploy.returncode == 0, deploy.stdout[-3000:] + deploy.stderr[-3000:]
    log = open(work / "worker.log", "w")
    worker = subprocess.Popen([PREFECT, "worker", "start", "--pool", "genrun-local"], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield work
    finally:
        kill_group(worker)
        log.close()


# CI time: the UI-retry test below runs through the same deployment and worker in make test.
@pytest.mark.extended
def test_prefect_yaml_deploys_both_deployments_and_runs_through_a_worker(prefect_server, deployed):
    nightly = prefect_server.api("GET", "/deployments/name/generate/generate-nightly")
    assert [s["schedule"]["cron"] for s in nightly["schedules"]] == ["0 2 * * *"]
    assert nightly["parameters"]["overrides"] == ["trainer.experiment_name=nightly-${genrun:scheduled_date}"]
    prompts = write_parquet(deployed / "prompts.parquet", chat_rows(6))
    out = deployed / "on-demand"
    params = json.dumps(_instant(prompts, out))
    run = subprocess.run([PREFECT, "deployment", "run", "generate/generate", "--param", f"overrides={params}", "--watch", "--watch-timeout", "400"], cwd=REPO, env=prefect_server.env, timeout=500, capture_output=True, text=True)
    assert "Completed" in run.stdout, run.stdout[-3000:] + (deployed / "worker.log").read_text()[-3000:]
    assert len(DataProto.load_from_disk(str(out / "trajectories.pkl"))) == 6


def test_exhausted_shard_fails_the_flow_and_a_ui_retry_reruns_only_that_shard(prefect_server, deployed):
    prompts = write_parquet(deployed / "prompts-retry.parquet", chat_rows(9))
    out = deployed / "ui-retry"
    flag = deployed / "fail-always"
    flag.write_text("")
    overrides = _instant(
        prompts, out, "generation.num_shards=3", "generation.retries=0",
        f"actor_rollout_ref.rollout.agent.agent_loop_config_path={AGENT_LOOPS}", "actor_rollout_ref.rollout.agent.default_agent_loop=flaky_agent",
    )
    deployment = prefect_server.api("GET", "/deployments/name/generate/generate")
    flow_run = prefect_server.api("POST", f"/deployments/{deployment['id']}/create_flow_run", json={"parameters": {"overrides": overrides}})
    failed = prefect_server.wait_for_flow_run(flow_run["id"], {"FAILED", "CRASHED", "COMPLETED"})
    assert failed["state"]["type"] == "FAILED", failed["state"]
    shards = out / "shards"
    assert (shards / "shard-00000" / "_SUCCESS.json").exists() and (shards / "shard-00002" / "_SUCCESS.json").exists()
    assert not (shards / "shard-00001" / "_SUCCESS.json").exists()
    assert sorted(_task_states(prefect_server, flow_run["id"])) == ["Completed", "Completed", "Failed"]

    flag.unlink()
    # Exactly what the Retry button of the Prefect UI sends.
    prefect_server.api("POST", f"/flow_runs/{flow_run['id']}/set_state", json={"state": {"type": "SCHEDULED", "name": "AwaitingRetry", "message": "Retry from the UI"}})
    done = prefect_server.wait_for_flow_run(flow_run["id"], {"FAILED", "CRASHED", "COMPLETED"})
    assert done["state"]["type"] == "COMPLETED", done["state"]
    states = sorted(_task_states(prefect_server, flow_run["id"]))
    # The finished shards came from Prefect's persisted results; only shard 1 executed again.
    assert states.count("Cached") == 2 and states.count("Completed") == 3 and states.count("Failed") == 1, states
    data = DataProto.load_from_disk(str(out / "trajectories.pkl"))
    assert data.non_tensor_batch["index"].tolist() == list(range(9))
