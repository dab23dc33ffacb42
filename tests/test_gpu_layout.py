"""Contract tests for the GPU engines (`rollout.name=sglang` / `vllm`) on the CPU: the layout genrun
resolves is the one verl's replicas compute, wrong layouts are refused before anything starts,
and a boot through verl's real standalone placement on a Ray cluster with logical GPUs puts each
replica on GPUs of its own and shard tasks on none. SGLang and vLLM themselves need GPUs and do
not run here (docs/engines.md: what has run on GPUs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from generation_core.config.layout import check_cluster_resources, check_engine_installed, resolve_layout
from generation_core.config.loading import load_config
from generation_core.errors import GenrunError

REPO = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.timeout(240)


def _verl_replica(cfg):
    """verl's own arithmetic: RolloutReplica.__init__ (world size, nodes, GPUs per node) and
    LLMServerManager's replica count, from the rollout config verl reads."""
    from verl.workers.rollout.replica import RolloutReplica

    class Probe(RolloutReplica):
        async def launch_servers(self):
            raise AssertionError("not launched in a contract test")

    rollout = cfg.actor_rollout_ref.rollout
    probe = Probe(
        replica_rank=0, config=rollout, model_config=cfg.actor_rollout_ref.model, gpus_per_node=rollout.n_gpus_per_node
    )
    replicas = rollout.n_gpus_per_node * rollout.nnodes // probe.world_size
    return replicas, probe.world_size, probe.nnodes, probe.gpus_per_replica_node


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
@pytest.mark.parametrize(
    "gpus_per_node, nnodes, tp, dp, pp, replicas",
    [
        (8, 1, 1, 1, 1, 8),
        (8, 1, 2, 1, 1, 4),
        (8, 2, 4, 1, 1, 4),
        (8, 2, 8, 2, 1, 1),
        (4, 4, 2, 2, 1, 4),
        (8, 4, 16, 1, 1, 2),
    ],
)
def test_layout_matches_verls_replicas(engine, gpus_per_node, nnodes, tp, dp, pp, replicas):
    cfg = load_config(
        [
            f"actor_rollout_ref.rollout.name={engine}",
            f"trainer.n_gpus_per_node={gpus_per_node}",
            f"trainer.nnodes={nnodes}",
            f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp}",
            f"actor_rollout_ref.rollout.data_parallel_size={dp}",
            f"actor_rollout_ref.rollout.pipeline_model_parallel_size={pp}",
            "actor_rollout_ref.rollout.gpu_memory_utilization=0.9",
            # The engine's own kwargs (another engine's are refused: config/verl_keys.py).
            f"actor_rollout_ref.rollout.engine_kwargs.{engine}.attention_backend=fa3",
        ]
    )
    layout = resolve_layout(cfg)
    verl_replicas, world, nodes, per_node = _verl_replica(cfg)
    assert layout.replicas == verl_replicas == replicas
    assert (layout.gpus_per_replica, layout.nodes_per_replica, layout.gpus_per_replica_node) == (world, nodes, per_node)
    assert layout.total_gpus == gpus_per_node * nnodes
    assert len(layout.placement_groups) == nodes and all(len(group) == per_node for group in layout.placement_groups)
    # What verl's replica is given: memory share and engine kwargs pass through untouched.
    rollout = cfg.actor_rollout_ref.rollout
    assert rollout.gpu_memory_utilization == 0.9 and rollout.engine_kwargs[engine].attention_backend == "fa3"
    assert rollout.n_gpus_per_node == gpus_per_node and rollout.nnodes == nnodes


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            [
                "actor_rollout_ref.rollout.name=sglang",
                "trainer.n_gpus_per_node=6",
                "actor_rollout_ref.rollout.tensor_model_parallel_size=4",
            ],
            "cannot be split into replicas",
        ),
        (
            [
                "actor_rollout_ref.rollout.name=vllm",
                "trainer.n_gpus_per_node=1",
                "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
            ],
            "cannot be split into replicas",
        ),
        (
            [
                "actor_rollout_ref.rollout.name=sglang",
                "trainer.n_gpus_per_node=4",
                "trainer.nnodes=3",
                "actor_rollout_ref.rollout.tensor_model_parallel_size=8",
            ],
            "cannot be split into replicas",
        ),
        (
            [
                "actor_rollout_ref.rollout.name=sglang",
                "trainer.n_gpus_per_node=4",
                "trainer.nnodes=6",
                "actor_rollout_ref.rollout.tensor_model_parallel_size=6",
            ],
            "cannot span nodes of 4 GPUs evenly",
        ),
        (
            ["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.gpu_memory_utilization=0"],
            "gpu_memory_utilization=0",
        ),
        # verl's own default: random weights, found generating gibberish on the first GPU sitting.
        (
            ["actor_rollout_ref.rollout.name=sglang", "actor_rollout_ref.rollout.load_format=dummy"],
            "load_format=dummy: sglang would generate from random weights",
        ),
        (
            ["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.load_format=dummy"],
            "load_format=dummy: vllm would generate from random weights",
        ),
        (
            ["actor_rollout_ref.rollout.name=sglang", "trainer.n_gpus_per_node=0"],
            "trainer.n_gpus_per_node=0: must be an integer >= 1",
        ),
        (
            ["actor_rollout_ref.rollout.tensor_model_parallel_size=2", "trainer.n_gpus_per_node=2"],
            "rollout.name=hf has no model parallelism",
        ),
        (["actor_rollout_ref.rollout.engine_kwargs.hf.device=tpu"], "engine_kwargs.hf.device='tpu': use cpu or cuda"),
        # verl 0.9.1 has no pipeline parallelism for either engine (its RolloutConfig says so).
        (
            [
                "actor_rollout_ref.rollout.name=sglang",
                "trainer.n_gpus_per_node=4",
                "actor_rollout_ref.rollout.pipeline_model_parallel_size=2",
            ],
            "verl refuses this rollout config .*pipeline_model_parallel_size > 1",
        ),
        (
            [
                "actor_rollout_ref.rollout.name=vllm",
                "trainer.n_gpus_per_node=4",
                "actor_rollout_ref.rollout.pipeline_model_parallel_size=2",
            ],
            "verl refuses this rollout config .*pipeline_model_parallel_size > 1",
        ),
    ],
)
def test_wrong_layouts_are_refused_in_the_config(overrides, message):
    with pytest.raises(GenrunError, match=message):
        load_config(overrides)


@pytest.mark.parametrize(
    "engine, fix",
    [
        ("sglang", "pip install 'genrun\\[sglang\\]'"),
        ("vllm", "cannot be installed beside Prefect 3.8.8 .*use rollout.name=remote"),
    ],
)
def test_missing_engine_package_names_the_fix(engine, fix):
    if __import__("importlib").util.find_spec(engine) is not None:
        pytest.skip(f"{engine} is installed here")
    with pytest.raises(GenrunError, match=f"needs the {engine} package .*{fix}"):
        check_engine_installed(engine)


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_gpu_engines_load_the_checkpoint_not_verls_dummy_weights(engine):
    """verl's RolloutConfig defaults to load_format=dummy (random weights, replaced by the trainer's
    in RL). The config verl's server builds from genrun's must load model.path: on the first GPU
    sitting, SGLang through verl generated from random weights (every logprob -ln(vocab))."""
    from verl.utils.config import omega_conf_to_dataclass

    cfg = load_config([f"actor_rollout_ref.rollout.name={engine}"])
    assert omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout).load_format == "auto"


def test_cluster_without_the_gpus_or_cpus_is_refused_before_placement():
    layout = resolve_layout(
        load_config(
            [
                "actor_rollout_ref.rollout.name=sglang",
                "trainer.n_gpus_per_node=8",
                "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
            ]
        )
    )
    with pytest.raises(GenrunError, match="need 8 GPU\\(s\\) but the Ray cluster has 4"):
        check_cluster_resources(layout, {"GPU": 4.0, "CPU": 64.0})
    # verl's bundles hold 2 CPUs per GPU; a shard task needs one more.
    with pytest.raises(GenrunError, match="hold 16 Ray CPUs .* the Ray cluster has 16 CPUs"):
        check_cluster_resources(layout, {"GPU": 8.0, "CPU": 16.0})
    check_cluster_resources(layout, {"GPU": 8.0, "CPU": 17.0})


def test_hf_on_cuda_holds_one_gpu_per_replica():
    from generation_core.engines.replicas import HFReplica

    cfg = load_config(["trainer.device=cuda", "trainer.n_gpus_per_node=2"])
    layout = resolve_layout(cfg)
    assert (layout.replicas, layout.gpus_per_replica, layout.placement_groups) == (2, 1, [])
    assert cfg.actor_rollout_ref.rollout.engine_kwargs.hf.device == "cuda"
    replica = HFReplica(
        replica_rank=0, config=cfg.actor_rollout_ref.rollout, model_config=cfg.actor_rollout_ref.model, gpus_per_node=2
    )
    assert replica.gpus() == 1
    cpu = load_config([])
    assert resolve_layout(cpu).gpus_per_replica == 0
    assert (
        HFReplica(replica_rank=0, config=cpu.actor_rollout_ref.rollout, model_config=cpu.actor_rollout_ref.model).gpus()
        == 0
    )


@pytest.mark.slow
def test_boot_on_logical_gpus_places_replicas_on_their_own_gpus_and_shards_on_none():
    env = dict(os.environ, RAY_AUTH_MODE="disabled", CONTRACT_GPUS="4", CONTRACT_CPUS="10")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.gpu_layout_contract",
            "trainer.n_gpus_per_node=4",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=200,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("CONTRACT ")]
    assert lines, done.stdout[-2000:] + done.stderr[-3000:]
    result = json.loads(lines[-1][len("CONTRACT ") :])
    assert result["replicas"] == result["layout"]["replicas"] == 2
    gpus_by_replica: dict[int, list[str]] = {}
    for placement in result["placements"]:
        gpus_by_replica.setdefault(placement["replica"], []).extend(placement["gpu_ids"])
    assert sorted(len(g) for g in gpus_by_replica.values()) == [2, 2]
    assert sorted(g for gs in gpus_by_replica.values() for g in gs) == ["0", "1", "2", "3"]
    assert result["placement_groups_per_replica"] == len(result["layout"]["placement_groups"]) == 1
    assert result["bundles"] == [{k: float(v) for k, v in b.items()} for b in result["layout"]["placement_groups"][0]]
    assert len(result["tokens"]) > 0
    assert result["shard_task"]["gpu_ids"] == []


def test_a_gpu_engine_that_this_machine_cannot_hold_is_refused_in_preflight(tmp_path, monkeypatch):
    """Audit 2026-11-28 #14: `hf.device=cuda` where the run starts Ray on this machine (no
    ray_init.address) and the machine has no GPU was refused only after Prefect and Ray started and
    run.json and a lease were written, so the corrected command met "a different run". The local
    machine's resources, counted by Ray's own rule (here ray_init.num_gpus=0), refuse it in the
    preflight, before the engine stack plans anything and with the output folder never made."""
    import ray

    from generation_core.preflight.preflight import check_inputs, plan_run
    from tests.conftest import chat_rows, write_parquet

    monkeypatch.setattr(ray, "is_initialized", lambda: False)  # another test's Ray is not this run's
    prompts = write_parquet(tmp_path / "p.parquet", chat_rows(2))
    out = tmp_path / "out"
    overrides = [f"data.train_files={prompts}", f"trainer.default_local_dir={out}", "trainer.device=cuda"]
    inputs = check_inputs([*overrides, "+ray_kwargs.ray_init.num_gpus=0"])
    with pytest.raises(GenrunError) as refused:
        plan_run(inputs)
    assert str(refused.value).startswith(
        "1 hf replica(s) x 1 GPU(s) (tp=1 dp=1 pp=1, 1 node(s) each) need 1 GPU(s) but this machine "
        "(ray_kwargs.ray_init.address is unset: the run starts Ray here) has 0; "
        "set actor_rollout_ref.rollout.engine_kwargs.hf.device=cpu, "
    ), refused.value
    assert not out.exists(), "a refused run leaves no output folder"
    # A Ray started separately is asked at its boot (the driver's check below), not here.
    plan_run(check_inputs([*overrides, "ray_kwargs.ray_init.address=127.0.0.1:1"]))


def test_the_driver_checks_the_joined_rays_gpus_before_it_writes_run_json_or_a_lease(tmp_path, monkeypatch):
    """Audit 2026-11-28 #14, on a Ray cluster: the GPUs are checked against the Ray the run joined
    before the lease and run.json are written, so the corrected command finds the folder as it was."""
    import ray

    from generation_core.driver.run_driver import drive_run
    from generation_core.preflight.preflight import preflight
    from tests.conftest import chat_rows, write_parquet

    prompts = write_parquet(tmp_path / "p.parquet", chat_rows(2))
    out = tmp_path / "out"
    plan = preflight(
        [
            f"data.train_files={prompts}",
            f"trainer.default_local_dir={out}",
            "trainer.device=cuda",
            "ray_kwargs.ray_init.address=127.0.0.1:1",
        ]
    )
    # The Ray the CLI joined beside the Prefect server, before the flow drives the run: no GPU.
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 16.0})
    with pytest.raises(GenrunError, match=r"need 1 GPU\(s\) but the Ray cluster has 0"):
        drive_run(plan, submitter=None, started=0.0)  # type: ignore[arg-type]  # refused before it is used
    assert not out.exists() or not any(out.rglob("*")), sorted(out.rglob("*"))
