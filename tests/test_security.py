"""What genrun promises about security: no remote code by default, no credentials in the run
folder, no pickle in part files, and its own Ray and Prefect server reachable from this host only."""

from __future__ import annotations

import json
import os
import pickle

import pytest

from generation_core.config.loading import load_config

pytestmark = pytest.mark.timeout(120)


# --- trust_remote_code -----------------------------------------------------------------------


def test_trust_remote_code_is_off_by_default():
    assert load_config([]).actor_rollout_ref.model.trust_remote_code is False


def test_the_tokenizer_is_loaded_without_remote_code(tmp_path, model_dir, monkeypatch, fresh_tokenizer_cache):
    import verl.utils

    from generation_core.preflight.preflight import preflight
    from tests.conftest import chat_rows, write_parquet

    calls = []
    real = verl.utils.hf_tokenizer

    def recording_hf_tokenizer(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    # preflight imports verl's loader when it needs it (after the light checks): patched at its source.
    monkeypatch.setattr(verl.utils, "hf_tokenizer", recording_hf_tokenizer)
    prompts = write_parquet(tmp_path / "p.parquet", chat_rows(2))
    preflight([f"data.train_files={prompts}", f"trainer.default_local_dir={tmp_path / 'out'}"])
    assert calls and all(call.get("trust_remote_code") is False for call in calls), calls


@pytest.mark.parametrize(
    "override, expected", [(None, False), ("actor_rollout_ref.model.trust_remote_code=true", True)]
)
def test_the_engine_loads_the_model_with_remote_code_only_when_asked(override, expected, monkeypatch):
    import generation_core.engines.hf.engine as hf
    from generation_core.engines.replicas import HFReplica

    cfg = load_config([override] if override else [])
    built = []
    monkeypatch.setattr(hf, "HFEngine", lambda settings: built.append(settings))
    HFReplica(0, cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref.model, gpus_per_node=1).build_engine()()
    assert built[0].trust_remote_code is expected


# --- credentials -----------------------------------------------------------------------------

SECRETS = {"key": "AKIAEXAMPLEKEY123", "secret": "s3cr3t-value-xyz", "token": "session-token-abc"}


def test_credential_overrides_move_to_the_environment(monkeypatch):
    from flows.cli import CREDENTIAL_OVERRIDES, move_credentials_to_environment

    for variable in CREDENTIAL_OVERRIDES.values():
        monkeypatch.delenv(variable, raising=False)
    kept = move_credentials_to_environment(
        [f"storage.options.{name}={value}" for name, value in SECRETS.items()] + ["generation.num_shards=2"]
    )
    assert kept == ["generation.num_shards=2"]
    assert {CREDENTIAL_OVERRIDES[f"storage.options.{name}"]: value for name, value in SECRETS.items()}.items() <= dict(
        os.environ
    ).items()


def test_run_json_holds_no_credentials(tmp_path):
    """Credentials that reach the config anyway (a deployment's parameters, a Python caller)
    are masked in run.json, also inside nested options such as s3fs' client_kwargs."""
    from generation_core.run_plan import RunPlan, plan_shards
    from generation_core.store.run_folder import RUN_FILE

    overrides = [f"storage.options.{name}={value}" for name, value in SECRETS.items()]
    overrides += [
        "+storage.options.client_kwargs.aws_secret_access_key=nested-secret-789",
        "storage.options.endpoint_url=http://127.0.0.1:9000",
    ]
    cfg = load_config(overrides)
    cfg.trainer.default_local_dir = str(tmp_path / "run")
    RunPlan(cfg, "0" * 64, plan_shards(4, 1), 0).claim_folder()
    text = (tmp_path / "run" / RUN_FILE).read_text()
    for secret in [*SECRETS.values(), "nested-secret-789"]:
        assert secret not in text
    options = json.loads(text)["config"]["storage"]["options"]
    assert options["secret"] == options["client_kwargs"]["aws_secret_access_key"] == "<redacted>"
    assert options["endpoint_url"] == "http://127.0.0.1:9000", "what is not a credential is kept"


# One secret in each place a config holds one: a remote server's key, s3fs' client_kwargs, a
# reward judge's key, Ray workers' environment and the input bucket's options; and one of each
# shape the name rule alone misses: inside a list-valued override, inside a URL, under a name
# that says `webhook`.
CONFIG_SECRETS = {
    "actor_rollout_ref.rollout.engine_kwargs.remote.api_key": "sk-remote-5e1f0c8a",
    "+storage.options.client_kwargs.aws_secret_access_key": "s3-client-secret-77d2b1",
    "+reward.custom_reward_function.reward_kwargs.judge_api_key": "judge-key-a93c44",
    "+ray_kwargs.ray_init.runtime_env.env_vars.GENRUN_TEST_JUDGE_TOKEN": "ray-env-token-0b6e21",
    # A mapping at once: move_credentials_to_environment refuses data.storage_options.token=...
    "data.storage_options": "{token: input-token-c4d5e6, endpoint_url: null}",
    "+reward.custom_reward_function.reward_kwargs.judges": "[{name: second, api_key: list-key-9d8e7f}]",
    "+reward.custom_reward_function.reward_kwargs.judge_url": "'https://judge:url-pass-8c1d2e@judge.example/v1?sig=url-sig-4f5a6b&model=m'",
    "+reward.custom_reward_function.reward_kwargs.webhook_url": "https://hooks.example/services/webhook-path-31f0aa",
}
SECRET_TEXTS = [
    "sk-remote-5e1f0c8a",
    "s3-client-secret-77d2b1",
    "judge-key-a93c44",
    "ray-env-token-0b6e21",
    "input-token-c4d5e6",
    "list-key-9d8e7f",
    "url-pass-8c1d2e",
    "url-sig-4f5a6b",
    "webhook-path-31f0aa",
]
# The three of them as the flow run's `overrides` parameter holds them: masked, still overrides.
MASKED_OVERRIDES = [
    "+reward.custom_reward_function.reward_kwargs.judges=[{name:'second',api_key:'<redacted>'}]",
    "+reward.custom_reward_function.reward_kwargs.judge_url='https://<redacted>@judge.example/v1?sig=<redacted>&model=m'",
    "+reward.custom_reward_function.reward_kwargs.webhook_url='<redacted>'",
]

# 1.0 only where the shard worker's config and environment hold the judges' secrets again
# (compared by digest: this file is no place for the secrets' text either).
SECRET_CHECKING_REWARD = """
import hashlib, os

def compute_score(data_source, solution_str, ground_truth, extra_info=None, judge_api_key=None, judges=None, judge_url=None,
                  webhook_url=None, **kwargs):
    given = [judge_api_key, os.environ.get('GENRUN_TEST_JUDGE_TOKEN'), judges[0]["api_key"], judge_url, webhook_url]
    seen = hashlib.sha256("|".join(map(str, given)).encode()).hexdigest()
    return 1.0 if seen == "EXPECTED" else 0.0
"""
GIVEN_TO_THE_JUDGE = [
    "judge-key-a93c44",
    "ray-env-token-0b6e21",
    "list-key-9d8e7f",
    "https://judge:url-pass-8c1d2e@judge.example/v1?sig=url-sig-4f5a6b&model=m",
    "https://hooks.example/services/webhook-path-31f0aa",
]


def _secret_overrides(tmp_path) -> list[str]:
    import hashlib

    expected = hashlib.sha256("|".join(GIVEN_TO_THE_JUDGE).encode()).hexdigest()
    reward = tmp_path / "judge_reward.py"
    reward.write_text(SECRET_CHECKING_REWARD.replace("EXPECTED", expected))
    return [f"{key}={value}" for key, value in CONFIG_SECRETS.items()] + [
        f"reward.custom_reward_function.path={reward}"
    ]


def test_a_plan_sent_to_a_worker_holds_no_secret_and_the_worker_gets_them_back(tmp_path, model_dir, monkeypatch):
    """What crosses to a shard task (a Prefect parameter) is masked; the worker's plan, built
    from it in an environment that has the run's secrets (Ray's runtime env), holds them all:
    the S3 client kwargs reach s3fs, the judge's key the reward function."""
    from omegaconf import OmegaConf

    from generation_core.errors import GenrunError
    from generation_core.preflight.preflight import RunPlan, preflight
    from generation_core.secrets import SECRETS_ENV
    from generation_core.serving.ray_setup import RAY_WORKER_ENV, ray_init_kwargs
    from tests.conftest import chat_rows, write_parquet

    prompts = write_parquet(tmp_path / "p.parquet", chat_rows(2))
    plan = preflight(
        [f"data.train_files={prompts}", f"trainer.default_local_dir={tmp_path / 'out'}", *_secret_overrides(tmp_path)]
    )
    sent = plan.to_json()
    assert not [text for text in SECRET_TEXTS if text in sent]
    assert SECRETS_ENV in ray_init_kwargs(plan.cfg, plan.fingerprint, RAY_WORKER_ENV)["runtime_env"]["env_vars"], (
        "the run's workers get them"
    )
    worker_env = os.environ[SECRETS_ENV]
    monkeypatch.delenv(SECRETS_ENV)
    with pytest.raises(
        GenrunError, match=r"not given the run's secrets \(actor_rollout_ref.rollout.engine_kwargs.remote.api_key, "
    ):
        RunPlan.from_json(sent)  # rather than send the placeholder as the key
    monkeypatch.setenv(SECRETS_ENV, worker_env)
    assert OmegaConf.to_container(RunPlan.from_json(sent).cfg) == OmegaConf.to_container(plan.cfg)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_no_file_a_run_writes_holds_a_config_secret(tmp_path, model_dir, wandb_offline_dir):
    """One secret in each place a config holds one, one run through the CLI with its temporary
    Prefect server, W&B (offline) and its own Ray: no file under this test's folder (the run folder
    with its run.json, zip, manifest and report, the Prefect server's database and result storage,
    the W&B run, Ray's session logs) nor the terminal holds any secret's text, and the run still
    works: its reward function on the shard worker saw every judge secret and the Ray env var
    (rewards 1.0). Issue 43 item 6: also a secret inside a list-valued override, the credentials
    of a URL and a secret under a `webhook` name; the flow run's parameters hold those overrides
    masked. A run of its own: the secrets need a flow run with a real Prefect database."""
    import shutil
    import tempfile
    from pathlib import Path

    from generation_core.store.folder import StorageFolder
    from tests.conftest import chat_rows, run_genrun, write_parquet
    from tests.report_runs import committed_records

    prompts = write_parquet(tmp_path / "prompts.parquet", chat_rows(2))
    out = tmp_path / "run"
    # Ray's session folder (socket paths must stay short, so not under tmp_path); removed below.
    ray_tmp = tempfile.mkdtemp(prefix="gr-", dir="/tmp")
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "RAY_ADDRESS")}
    env.update(PREFECT_HOME=str(tmp_path / "prefect-home"), RAY_TMPDIR=ray_tmp)
    args = [
        f"data.train_files={prompts}",
        f"trainer.default_local_dir={out}",
        "actor_rollout_ref.rollout.name=instant",
        "generation.show_progress=false",
        "trainer.logger=[console,wandb]",
        *_secret_overrides(tmp_path),
    ]
    try:
        result = _run_without_inherited_env(run_genrun, args, env)
        assert result.returncode == 0, result.stderr[-3000:]
        assert [r.reward_score for r in committed_records(StorageFolder(str(out)))] == [1.0, 1.0], (
            "the worker got the secrets back"
        )
        written = [
            p
            for root in (tmp_path, ray_tmp)
            for p in Path(root).rglob("*")
            if p.is_file() and p.name != "judge_reward.py"
        ]
        names = {p.name for p in written}
        assert {"run.json", "manifest.json", "trajectories.zip", "report.html", "prefect.db"} <= names, sorted(names)
        leaks = {
            f"{p}: {text}"
            for p in written
            for text in SECRET_TEXTS
            if any(text.encode() in data for data in _contents(p))
        }
        leaks |= {f"terminal: {text}" for text in SECRET_TEXTS if text in result.stdout + result.stderr}
        assert not leaks, sorted(leaks)
        # The places that would hold the secrets were searched: they hold the masked config.
        database = next(p for p in written if p.name == "prefect.db").read_bytes()
        assert f"trainer.default_local_dir={out}".encode() in database and b"<redacted>" in database, (
            "the flow run's parameters are in it"
        )
        overrides = _flow_run_overrides(next(p for p in written if p.name == "prefect.db"))
        assert [
            o
            for o in overrides
            if o.startswith(
                ("+reward.custom_reward_function.reward_kwargs.j", "+reward.custom_reward_function.reward_kwargs.w")
            )
        ] == ["+reward.custom_reward_function.reward_kwargs.judge_api_key='<redacted>'", *MASKED_OVERRIDES]
        assert any(p.suffix == ".wandb" and b"<redacted>" in p.read_bytes() for p in written), (
            "the W&B run's config is in it"
        )
        assert any(str(p).startswith(ray_tmp) and p.suffix == ".log" for p in written), (
            "Ray's session logs are searched"
        )
        assert any(b"<redacted>" in member for p in written if p.suffix == ".zip" for member in _contents(p)[1:]), (
            "the zip's run.json is searched"
        )
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)


def _flow_run_overrides(database) -> list[str]:
    """The `overrides` parameter of the one flow run in a Prefect server's database (read-only)."""
    import sqlite3
    from contextlib import closing

    with closing(sqlite3.connect(f"file:{database}?mode=ro", uri=True)) as db:
        runs = [json.loads(parameters) for (parameters,) in db.execute("SELECT parameters FROM flow_run")]
    assert len(runs) == 1, runs
    return runs[0]["overrides"]


def _contents(path) -> list[bytes]:
    """A file's bytes, and a zip's members uncompressed (trajectories.zip deflates run.json)."""
    import zipfile

    data = [path.read_bytes()]
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as archive:
            data += [archive.read(name) for name in archive.namelist()]
    return data


def _run_without_inherited_env(run_genrun, args, env):
    """run_genrun merges os.environ under `env`: PREFECT_API_URL of a session server must not
    reach this run (it starts its own temporary server, whose database is under tmp_path)."""
    saved = {k: os.environ.pop(k) for k in ("PREFECT_API_URL", "RAY_ADDRESS") if k in os.environ}
    try:
        return run_genrun(args, env=env, timeout=540)
    finally:
        os.environ.update(saved)


# --- part files ------------------------------------------------------------------------------


def test_parts_are_parquet_and_a_pickle_in_their_place_is_never_loaded(tmp_path):
    import pyarrow as pa

    from generation_core.store.trajectory_record import TrajectoryRecord, records_from_parquet, records_to_parquet

    record = TrajectoryRecord(
        index=0,
        rollout_n=0,
        prompt_ids=[1, 2],
        response_ids=[3],
        response_mask=[1],
        response_logprobs=None,
        reward_score=None,
        num_turns=2,
    )
    data = records_to_parquet([record])
    assert data[:4] == b"PAR1" and data[-4:] == b"PAR1"
    assert records_from_parquet(data) == [record]

    marker = tmp_path / "code-ran"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    with pytest.raises(pa.ArrowInvalid):
        records_from_parquet(pickle.dumps(Payload()))
    assert not marker.exists(), "a part file is never unpickled"


# --- network ---------------------------------------------------------------------------------


def test_ray_started_by_genrun_listens_on_loopback_only(monkeypatch):
    """Without an address genrun starts its own Ray: no dashboard, and every Ray server on
    127.0.0.1. Ray on Linux would otherwise swap 127.0.0.1 for the host's routable IP and listen
    on every interface; genrun switches on Ray's single-machine mode for it."""
    import ray
    from ray._private import ray_constants, services

    from generation_core.serving.ray_setup import ray_init_kwargs

    monkeypatch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", True)
    monkeypatch.setenv(ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR, "1")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    kwargs = ray_init_kwargs(load_config([]), "0" * 64)
    assert kwargs["_node_ip_address"] == "127.0.0.1"
    assert kwargs["include_dashboard"] is False
    assert ray_constants.ENABLE_RAY_CLUSTER is False
    if not ray.is_initialized():
        assert services.resolve_ip_for_localhost("127.0.0.1") == "127.0.0.1", "Ray keeps loopback as the node's address"
    assert os.environ[ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR] == "0", "the processes Ray starts inherit it"


def test_ray_of_an_existing_cluster_is_left_as_configured(monkeypatch):
    from ray._private import ray_constants

    from generation_core.serving.ray_setup import ray_init_kwargs

    monkeypatch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", True)
    kwargs = ray_init_kwargs(load_config(["ray_kwargs.ray_init.address=10.0.0.5:6379"]), "0" * 64)
    assert "_node_ip_address" not in kwargs and "include_dashboard" not in kwargs
    assert ray_constants.ENABLE_RAY_CLUSTER is True


def test_the_temporary_prefect_server_listens_on_loopback_only(monkeypatch):
    """flows/prefect_api.py's server, launched for real up to the process start: the URL it
    exports and the uvicorn command line (Prefect's own server process) both say 127.0.0.1."""
    import subprocess

    from flows import prefect_api

    launched = []
    real_popen = subprocess.Popen

    def popen(command, **kwargs):
        launched.append(command)
        return real_popen(["sleep", "600"])

    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    monkeypatch.setattr(prefect_api.subprocess, "Popen", popen)
    server = prefect_api.TemporaryPrefectServer.launch()
    try:
        assert server.api_url == os.environ["PREFECT_API_URL"] == f"http://127.0.0.1:{server.port}/api"
    finally:
        server.stop()
    [command] = launched
    assert command[1:5] == ["-m", "uvicorn", "--factory", "prefect.server.api.server:create_app"]
    assert command[command.index("--host") + 1] == "127.0.0.1"
    assert "PREFECT_API_URL" not in os.environ


_LISTENING_SOCKETS_OF_GENRUN_RAY = """
import json, os, sys
import psutil, ray
from generation_core.config.loading import load_config
from generation_core.serving.ray_setup import ray_init_kwargs

ray.init(**ray_init_kwargs(load_config([]), "0" * 64))
try:
    addresses = set()
    for process in [psutil.Process(), *psutil.Process().children(recursive=True)]:
        try:
            addresses |= {c.laddr.ip for c in process.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN}
        except psutil.Error:
            pass
    print(json.dumps(sorted(addresses)))
finally:
    ray.shutdown()
"""


@pytest.mark.slow
def test_ray_processes_listen_on_no_other_interface():
    """The sockets themselves: GCS, raylet, agents and the idle workers of the Ray genrun starts
    (a Ray start in a fresh process: about 10 s of CPU)."""
    import subprocess
    import sys

    from tests.conftest import REPO

    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")}
    result = subprocess.run(
        [sys.executable, "-c", _LISTENING_SOCKETS_OF_GENRUN_RAY],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    addresses = json.loads(result.stdout.strip().splitlines()[-1])
    assert addresses and set(addresses) <= {"127.0.0.1", "::ffff:127.0.0.1", "::1"}, addresses
