"""The Prefect flow on a real Prefect server and a real local Ray cluster: sharded runs,
task retries that resume from the checkpoint, the UI's artifacts, a killed shard worker that
Ray does not re-run (one retry knob: Prefect's) and an n=4 sampled rerun that equals an
undisturbed run record by record, failed shards, the UI's retry of a failed flow run, and the
repo's prefect.yaml deployed and run through a process worker (the nightly deployment's folder
named after the scheduled date)."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from datetime import UTC
from pathlib import Path

import pytest
import torch
from verl.protocol import DataProto

from generation_core.driver.in_process import run_in_process
from generation_core.outputs.padding import RUN_DEPENDENT_KEYS
from generation_core.preflight.preflight import preflight
from tests.conftest import GENRUN, REPO, chat_rows, kill_group, run_genrun, write_parquet
from tests.run_folder_helpers import checkpoint_dict, has_committed_part

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
        if key not in RUN_DEPENDENT_KEYS:
            assert actual.non_tensor_batch[key].tolist() == expected.non_tensor_batch[key].tolist(), key


def _task_states(server, flow_run_id, count: int, settle_seconds: float = 60.0):
    """The shard task runs' state names, once `count` task runs exist and none is still
    Running/Pending. A task on a Ray worker reports its states on its own, as events the server
    records when it gets to them. The flow waits for them before it stops Ray (a cached shard
    ended right before used to lose its events with its worker: flows/task_run_states.py), but
    the server may record them a moment after the flow run's own final state."""
    deadline = time.monotonic() + settle_seconds
    while True:
        runs = server.api("POST", "/task_runs/filter", json={"flow_runs": {"id": {"any_": [flow_run_id]}}})
        states = [r["state"]["name"] for r in runs if r["name"].startswith("shard-")]
        if (len(states) >= count and not {"Running", "Pending"} & set(states)) or time.monotonic() > deadline:
            return states
        time.sleep(0.5)


def _flow_runs_of(server, out) -> list[dict]:
    """The flow runs (oldest first) whose overrides name `out` as their output folder."""
    wanted = f"trainer.default_local_dir={out}"
    runs = server.api("POST", "/flow_runs/filter", json={"sort": "EXPECTED_START_TIME_ASC"})
    return [r for r in runs if wanted in (r["parameters"].get("overrides") or [])]


def _artifacts(server, flow_run_id) -> dict[str, dict]:
    return {
        a["key"]: a
        for a in server.api("POST", "/artifacts/filter", json={"artifacts": {"flow_run_id": {"any_": [flow_run_id]}}})
    }


# CI time: in make test the chaos schedule runs the flow (2 shards on Ray) and compares it with an
# undisturbed run, and the UI-retry test below runs 3 shards through a deployment.
@pytest.mark.extended
def test_three_shards_on_ray_equal_the_in_process_run(prefect_server, ray_local, tmp_path):
    prompts = write_parquet(tmp_path / "prompts.parquet", chat_rows(10))
    result = run_genrun([*_instant(prompts, tmp_path / "flow"), "generation.num_shards=3"], env=prefect_server.env)
    assert result.returncode == 0, result.stderr[-3000:]
    in_process = run_in_process(preflight([*_instant(prompts, tmp_path / "plain"), "generation.num_shards=3"]))
    assert in_process["num_trajectories"] == 10
    _assert_same_dataproto(
        DataProto.load_from_disk(str(tmp_path / "flow" / "trajectories.pkl")),
        DataProto.load_from_disk(str(tmp_path / "plain" / "trajectories.pkl")),
    )

    (flow_run,) = _flow_runs_of(prefect_server, tmp_path / "flow")
    assert flow_run["state"]["type"] == "COMPLETED"
    assert sorted(_task_states(prefect_server, flow_run["id"], 3)) == ["Completed"] * 3
    artifacts = {
        a["key"]: a
        for a in prefect_server.api(
            "POST", "/artifacts/filter", json={"artifacts": {"flow_run_id": {"any_": [flow_run["id"]]}}}
        )
    }
    progress = next(a for k, a in artifacts.items() if k.endswith("-progress"))
    assert progress["data"] == 100.0
    table = next(a for k, a in artifacts.items() if k.endswith("-shards"))
    rows = json.loads(table["data"])
    assert sorted(r["shard"] for r in rows) == ["shard-00000", "shard-00001", "shard-00002"]
    assert sum(r["samples"] for r in rows) == 10
    assert any(k.endswith("-output") for k in artifacts)


# Extended: make test holds a failed shard retried from the UI and resuming (test_exhausted_shard_fails_the_flow_and_a_ui_retry_reruns_only_that_shard) and a killed worker's shard resumed (test_a_killed_shard_worker_...).
@pytest.mark.extended
def test_a_shard_failing_once_is_retried_and_resumes_from_its_checkpoint(prefect_server, tmp_path):
    prompts = write_parquet(tmp_path / "prompts.parquet", chat_rows(8))
    flag = tmp_path / "fail-once"
    flag.write_text("")
    trace = tmp_path / "samples.trace"
    # The worker looks for scheduled flow runs every second (Prefect's default: 10 s), so the
    # tests do not wait on its polling.
    env = dict(
        prefect_server.env,
        PREFECT_WORKER_QUERY_SECONDS="1",
        GENRUN_TEST_FAIL_FLAG=str(flag),
        GENRUN_TEST_FAIL_INDEX="5",
        GENRUN_TEST_FAIL_MODE="once",
        GENRUN_SAMPLE_TRACE=str(trace),
    )
    args = _instant(
        prompts,
        tmp_path / "run",
        "generation.max_inflight=2",
        "generation.retries=1",
        "generation.retry_delay_seconds=0",
        f"actor_rollout_ref.rollout.agent.agent_loop_config_path={AGENT_LOOPS}",
        "actor_rollout_ref.rollout.agent.default_agent_loop=flaky_agent",
    )
    result = run_genrun(args, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    # verl's whole-dataset load (RLHFDataset over data.train_files, which prints "filter dataset
    # len") runs nowhere: the driver plans from metadata and a sample, the shard reads its rows.
    assert (result.stdout + result.stderr).count("filter dataset len") == 0, result.stdout[-3000:]
    # The terminal summary is the one place for the run's figures: verl's console logger line
    # (`step:0 - generation/...`) only with trainer.logger=[console] asked for.
    assert "step:0 - " not in result.stdout + result.stderr, result.stdout[-3000:]
    assert not flag.exists(), "the injected failure happened"
    marker = json.loads((tmp_path / "run" / "shards" / "shard-00000" / "_SUCCESS.json").read_text())
    assert marker["attempts"] == 2 and marker["num_trajectories"] == 8
    finished = re.findall(r"finished (\d+:\d+)", trace.read_text())
    # Samples committed before the failure were not generated again by the retry.
    assert finished.count("0:0") == 1 and finished.count("1:0") == 1
    assert len(finished) <= 8 + 2, "at most max_inflight samples regenerated"
    data = DataProto.load_from_disk(str(tmp_path / "run" / "trajectories.pkl"))
    assert data.non_tensor_batch["index"].tolist() == list(range(8))

    # The Prefect UI's view of the run: a progress bar at 100 %, the shard table, the output note.
    (flow_run,) = _flow_runs_of(prefect_server, tmp_path / "run")
    artifacts = _artifacts(prefect_server, flow_run["id"])
    experiment = json.loads((tmp_path / "run" / "run.json").read_text())["config"]["trainer"]["experiment_name"]
    key = experiment.lower().replace("_", "-")
    assert {f"{key}-progress", f"{key}-shards", f"{key}-output"} <= set(artifacts), sorted(artifacts)
    assert artifacts[f"{key}-progress"]["type"] == "progress" and artifacts[f"{key}-progress"]["data"] == 100.0
    assert artifacts[f"{key}-shards"]["type"] == "table"
    (row,) = json.loads(artifacts[f"{key}-shards"]["data"])
    assert row["shard"] == "shard-00000" and row["samples"] == 8, row
    assert str(tmp_path / "run") in artifacts[f"{key}-output"]["data"]


GATED_LOOPS = REPO / "tests" / "chaos" / "agent_loops.yaml"
PROMPTS, N = 3, 4


def _shard_workers(timeline: Path) -> list[int]:
    """PIDs of the processes that started shard 0, from the run's timeline (GENRUN_TIMELINE)."""
    return [int(pid) for pid in re.findall(r"^shard_worker_ready 0 pid=(\d+) ", timeline.read_text(), re.MULTILINE)]


def _same_records(actual, expected) -> None:
    """Record by record, every field but the timings (metrics)."""
    assert [r.key for r in actual] == [r.key for r in expected]
    for ours, theirs in zip(actual, expected, strict=True):
        for name in (
            "prompt_ids",
            "response_ids",
            "response_mask",
            "response_logprobs",
            "reward_score",
            "num_turns",
            "input_fields",
            "extra_fields",
        ):
            assert getattr(ours, name) == getattr(theirs, name), (ours.key, name)


def test_a_killed_shard_worker_fails_the_flow_without_retries_and_the_rerun_equals_an_undisturbed_run(
    prefect_server, ray_local, tmp_path
):
    """generation.retries=0 and a shard worker killed (-9, by PID) mid-shard: Ray does not run
    the shard again behind Prefect's back (shard tasks go to Ray with max_retries=0), the shard
    and the flow fail, and the same command resumes from the checkpoint. Sampled at temperature
    1 with n=4 and one prompt's rollouts split by the kill (3 committed, 1 not): the resumed
    run equals an undisturbed one record by record, so a rollout-number mix-up shows."""
    from generation_core.store.folder import StorageFolder
    from tests.merge_oracles import read_committed_records

    prompts = write_parquet(tmp_path / "prompts.parquet", chat_rows(PROMPTS))
    out, gate, timeline = tmp_path / "run", tmp_path / "gate", tmp_path / "timeline.txt"

    def args(folder):
        return _instant(
            prompts,
            folder,
            f"actor_rollout_ref.rollout.n={N}",
            "actor_rollout_ref.rollout.temperature=1.0",
            "generation.sample_seed=11",
            "generation.save_batch_size=3",
            "generation.retries=0",
            "generation.retry_delay_seconds=0",
            f"actor_rollout_ref.rollout.agent.agent_loop_config_path={GATED_LOOPS}",
            "actor_rollout_ref.rollout.agent.default_agent_loop=gated_agent",
        )

    # Prompt 0's four samples pass the gate: three commit as the first part, one stays in the
    # buffer; prompts 1 and 2 wait at the gate until the kill.
    env = dict(
        os.environ,
        **prefect_server.env,
        GENRUN_TEST_GATE=str(gate),
        GENRUN_TEST_GATE_FROM="1",
        GENRUN_TIMELINE=str(timeline),
    )
    gate.write_text("")
    log_path = tmp_path / "killed.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            GENRUN + args(out),
            cwd=REPO,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        try:
            deadline = time.monotonic() + 300
            while not has_committed_part(out):
                assert process.poll() is None, f"genrun exited early:\n{log_path.read_text()[-3000:]}"
                assert time.monotonic() < deadline, f"no part committed in time:\n{log_path.read_text()[-3000:]}"
                time.sleep(0.1)
            (worker_pid,) = _shard_workers(timeline)
            os.kill(worker_pid, signal.SIGKILL)
            deadline = time.monotonic() + 240
            while process.poll() is None:
                # A second worker on the shard (held at the gate again) is Ray re-running the task.
                assert _shard_workers(timeline) == [worker_pid], (
                    f"the shard ran again after its worker was killed: {_shard_workers(timeline)}"
                )
                assert time.monotonic() < deadline, (
                    f"genrun did not end after its only shard failed:\n{log_path.read_text()[-3000:]}"
                )
                time.sleep(0.2)
        finally:
            kill_group(process)
            gate.unlink()
    output = log_path.read_text()
    assert process.returncode != 0, output[-3000:]
    assert re.search(
        r"^genrun: error: 1 of 1 shards failed \(generation.retries=0\): shard-00000 Crashed.*WorkerCrashedError.*run the same command again",
        output.strip().splitlines()[-1],
    ), output[-3000:]
    at_kill = checkpoint_dict(out)
    assert len(at_kill["completed"]) == 3 and {key.split(":")[0] for key in at_kill["completed"]} == {"0"}, at_kill[
        "completed"
    ]
    # One attempt: no second worker started the shard, the checkpoint counts one, and Prefect's
    # task run ran once (a re-execution by Ray runs the same task run again).
    assert _shard_workers(timeline) == [worker_pid]
    assert at_kill["attempts"] == 1
    assert not (out / "shards" / "shard-00000" / "_SUCCESS.json").exists() and not (out / "trajectories.pkl").exists()
    (flow_run,) = _flow_runs_of(prefect_server, out)
    assert flow_run["state"]["type"] == "FAILED", flow_run["state"]
    (task_run,) = [
        r
        for r in prefect_server.api("POST", "/task_runs/filter", json={"flow_runs": {"id": {"any_": [flow_run["id"]]}}})
        if r["name"] == "shard-00000"
    ]
    assert task_run["run_count"] == 1, task_run
    # The worker died before it could report an end: the flow records the crash it saw, so the
    # UI does not show the shard Running forever.
    assert task_run["state"]["type"] == "CRASHED", task_run["state"]

    again = run_genrun(args(out), env=prefect_server.env)
    assert again.returncode == 0, again.stderr[-3000:]
    total = PROMPTS * N
    assert f"trajectories:  {total} ({total - 3} generated by this invocation)" in again.stdout, again.stdout[-2000:]
    marker = json.loads((out / "shards" / "shard-00000" / "_SUCCESS.json").read_text())
    assert marker["attempts"] == 2 and marker["num_trajectories"] == total

    # Issue 45 item 4: the same command on the finished run answers from the folder (no Prefect
    # server, Ray or engine starts) and rewrites nothing.
    written = {path: path.stat().st_mtime_ns for path in out.rglob("*") if path.is_file()}
    finished = run_genrun(args(out), env=prefect_server.env)
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert (
        f"trajectories:  {total} (every shard finished, merged output current: nothing to generate)" in finished.stdout
    ), finished.stdout
    assert (
        "running on:" not in finished.stdout + finished.stderr and "inference:" not in finished.stdout + finished.stderr
    )
    assert {path: path.stat().st_mtime_ns for path in out.rglob("*") if path.is_file()} == written

    run_in_process(preflight(args(tmp_path / "undisturbed")))
    resumed, undisturbed = (
        read_committed_records(StorageFolder(str(out))),
        read_committed_records(StorageFolder(str(tmp_path / "undisturbed"))),
    )
    assert [r.key for r in resumed] == [(i, n) for i in range(PROMPTS) for n in range(N)], (
        "every trajectory exactly once"
    )
    for index in range(PROMPTS):
        responses = [tuple(r.response_ids) for r in undisturbed if r.index == index]
        assert len(set(responses)) == N, (
            f"the {N} samples of prompt {index} are identical: the instant engine's tokens do not depend on the sample "
            "(generation.sample_seed), so this test cannot see a rollout-number mix-up on resume"
        )
    _same_records(resumed, undisturbed)
    merged, reference = (
        DataProto.load_from_disk(str(folder / "trajectories.pkl")) for folder in (out, tmp_path / "undisturbed")
    )
    _assert_same_dataproto(merged, reference)


@pytest.fixture(scope="module")
def deployed(prefect_server, tmp_path_factory):
    """prefect.yaml deployed against the test server, and a process worker serving the pool."""
    work = tmp_path_factory.mktemp("deployed")
    # The worker looks for scheduled flow runs every second (Prefect's default: 10 s), so the
    # tests do not wait on its polling.
    env = dict(
        prefect_server.env,
        PREFECT_WORKER_QUERY_SECONDS="1",
        GENRUN_TEST_FAIL_FLAG=str(work / "fail-always"),
        GENRUN_TEST_FAIL_INDEX="4",
        GENRUN_SAMPLE_TRACE=str(work / "samples.trace"),
    )
    subprocess.run(["bash", "infra/create_pool.sh"], cwd=REPO, env=env, check=True, timeout=120, capture_output=True)
    deploy = subprocess.run(
        [PREFECT, "--no-prompt", "deploy", "--all"], cwd=REPO, env=env, timeout=300, capture_output=True, text=True
    )
    assert deploy.returncode == 0, deploy.stdout[-3000:] + deploy.stderr[-3000:]
    log = open(work / "worker.log", "w")
    worker = subprocess.Popen(
        [PREFECT, "worker", "start", "--pool", "genrun-local"],
        cwd=REPO,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
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
    run = subprocess.run(
        [
            PREFECT,
            "deployment",
            "run",
            "generate/generate",
            "--param",
            f"overrides={params}",
            "--watch",
            "--watch-timeout",
            "400",
        ],
        cwd=REPO,
        env=prefect_server.env,
        timeout=500,
        capture_output=True,
        text=True,
    )
    assert "Completed" in run.stdout, run.stdout[-3000:] + (deployed / "worker.log").read_text()[-3000:]
    assert len(DataProto.load_from_disk(str(out / "trajectories.pkl"))) == 6


def test_exhausted_shard_fails_the_flow_and_a_ui_retry_reruns_only_that_shard(prefect_server, deployed):
    prompts = write_parquet(deployed / "prompts-retry.parquet", chat_rows(9))
    out = deployed / "ui-retry"
    flag = deployed / "fail-always"
    flag.write_text("")
    overrides = _instant(
        prompts,
        out,
        "generation.num_shards=3",
        "generation.retries=0",
        f"actor_rollout_ref.rollout.agent.agent_loop_config_path={AGENT_LOOPS}",
        "actor_rollout_ref.rollout.agent.default_agent_loop=flaky_agent",
    )
    deployment = prefect_server.api("GET", "/deployments/name/generate/generate")
    flow_run = prefect_server.api(
        "POST", f"/deployments/{deployment['id']}/create_flow_run", json={"parameters": {"overrides": overrides}}
    )
    failed = prefect_server.wait_for_flow_run(flow_run["id"], {"FAILED", "CRASHED", "COMPLETED"})
    assert failed["state"]["type"] == "FAILED", failed["state"]
    shards = out / "shards"
    assert (shards / "shard-00000" / "_SUCCESS.json").exists() and (shards / "shard-00002" / "_SUCCESS.json").exists()
    assert not (shards / "shard-00001" / "_SUCCESS.json").exists()
    assert sorted(_task_states(prefect_server, flow_run["id"], 3)) == ["Completed", "Completed", "Failed"]

    flag.unlink()
    # Exactly what the Retry button of the Prefect UI sends.
    prefect_server.api(
        "POST",
        f"/flow_runs/{flow_run['id']}/set_state",
        json={"state": {"type": "SCHEDULED", "name": "AwaitingRetry", "message": "Retry from the UI"}},
    )
    done = prefect_server.wait_for_flow_run(flow_run["id"], {"FAILED", "CRASHED", "COMPLETED"})
    assert done["state"]["type"] == "COMPLETED", done["state"]
    states = sorted(_task_states(prefect_server, flow_run["id"], 6))
    # The finished shards came from Prefect's persisted results; only shard 1 executed again.
    assert states.count("Cached") == 2 and states.count("Completed") == 3 and states.count("Failed") == 1, states
    data = DataProto.load_from_disk(str(out / "trajectories.pkl"))
    assert data.non_tensor_batch["index"].tolist() == list(range(9))


def test_the_nightly_config_names_its_folder_after_the_flow_runs_scheduled_date(prefect_server, deployed, tmp_path):
    """prefect.yaml's nightly deployment (cron, folder override) as deployed, and its override
    resolved inside a flow run scheduled for a past night (a late start, or a retry the next
    day): `${genrun:scheduled_date}` reads the flow run's scheduled time, not the clock. The
    config is resolved by preflight in a flow run on the real server, as the deployment's flow
    does first; the whole run through the worker is the extended test below (CI time)."""
    from datetime import datetime

    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.flow_engine import run_flow
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect.states import Scheduled

    nightly = prefect_server.api("GET", "/deployments/name/generate/generate-nightly")
    assert [s["schedule"]["cron"] for s in nightly["schedules"]] == ["0 2 * * *"]
    assert nightly["parameters"]["overrides"] == ["trainer.experiment_name=nightly-${genrun:scheduled_date}"]

    @flow(name="resolve-nightly-config", persist_result=False)
    def resolve(overrides: list[str]) -> str:
        return preflight(overrides).cfg.trainer.experiment_name

    prompts = write_parquet(tmp_path / "prompts.parquet", chat_rows(2))
    overrides = [
        *nightly["parameters"]["overrides"],
        f"data.train_files={prompts}",
        f"trainer.default_local_dir={tmp_path / 'run'}",
        "actor_rollout_ref.rollout.name=instant",
    ]
    night = datetime(2024, 3, 5, 2, tzinfo=UTC)
    with temporary_settings(updates={PREFECT_API_URL: prefect_server.env["PREFECT_API_URL"]}):
        with get_client(sync_client=True) as client:
            flow_run = client.create_flow_run(
                resolve, parameters={"overrides": overrides}, state=Scheduled(scheduled_time=night)
            )
        assert flow_run.expected_start_time.date() == night.date(), flow_run.expected_start_time
        assert run_flow(resolve, flow_run=flow_run, parameters={"overrides": overrides}) == "nightly-2024-03-05"
    # Outside a flow run it is the day's date (read before and after: the test may span midnight).
    days = [datetime.now(UTC).strftime("%Y-%m-%d")]
    name = preflight(overrides).cfg.trainer.experiment_name
    days.append(datetime.now(UTC).strftime("%Y-%m-%d"))
    assert name in [f"nightly-{day}" for day in days], name


# CI time: the test above resolves the same override in a flow run scheduled for a past night.
@pytest.mark.extended
def test_the_nightly_deployment_names_its_folder_after_the_scheduled_date(prefect_server, deployed):
    """A nightly flow run scheduled for a past night (a late start, or a retry the next day)
    writes to that night's folder: prefect.yaml's `${genrun:scheduled_date}` reads the flow
    run's scheduled time, not the clock."""
    nightly = prefect_server.api("GET", "/deployments/name/generate/generate-nightly")
    prompts = write_parquet(deployed / "prompts-nightly.parquet", chat_rows(2))
    # The deployment's own overrides (the folder name) plus a small instant run; no output
    # folder given, so it is outputs/<project>/<experiment> under the worker's directory.
    project = f"genrun-test-nightly-{os.getpid()}"
    overrides = [
        *nightly["parameters"]["overrides"],
        f"data.train_files={prompts}",
        f"trainer.project_name={project}",
        "actor_rollout_ref.rollout.name=instant",
        "generation.show_progress=false",
    ]
    night = "2024-03-05"
    state = {"type": "SCHEDULED", "name": "Scheduled", "state_details": {"scheduled_time": f"{night}T02:00:00+00:00"}}
    try:
        flow_run = prefect_server.api(
            "POST",
            f"/deployments/{nightly['id']}/create_flow_run",
            json={"parameters": {"overrides": overrides}, "state": state},
        )
        assert flow_run["expected_start_time"].startswith(night), flow_run["expected_start_time"]
        done = prefect_server.wait_for_flow_run(flow_run["id"], {"FAILED", "CRASHED", "COMPLETED"}, timeout=300)
        assert done["state"]["type"] == "COMPLETED", (done["state"], (deployed / "worker.log").read_text()[-3000:])
        folder = REPO / "outputs" / project / f"nightly-{night}"
        assert (folder / "trajectories.pkl").exists(), sorted(p.name for p in (REPO / "outputs" / project).glob("*"))
        assert (
            json.loads((folder / "run.json").read_text())["config"]["trainer"]["experiment_name"] == f"nightly-{night}"
        )
    finally:
        shutil.rmtree(REPO / "outputs" / project, ignore_errors=True)
