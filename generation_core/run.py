"""A generation run's steps, usable with or without Prefect.

`prepare_run` does every check that needs no model (config, model files, dataset, output
folder) so a wrong input is refused in seconds. `boot_pool`, `run_shard_job` and `finish_run`
are the pieces the Prefect flow wires together (shards on Ray workers); `execute_run` chains the
same pieces in one process (tests, notebooks), always tearing the replicas down.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from generation_core import bundled
from generation_core.config import finalize_run_location, fingerprint, load_config, versions
from generation_core.data import PromptSet, ShardSpec, check_prompt_files, plan_shards
from generation_core.errors import GenrunError
from generation_core.storage import RunFolder, redacted_options
from generation_core.timeline import mark

logger = logging.getLogger(__name__)

RUN_FILE = "run.json"
MANIFEST_FILE = "manifest.json"


@dataclass
class RunPlan:
    cfg: DictConfig
    fingerprint: str
    folder: RunFolder
    prompts: PromptSet
    shards: list[ShardSpec]
    pad_token_id: int


def check_model_dir(cfg: DictConfig) -> Path:
    path = Path(os.path.expanduser(cfg.actor_rollout_ref.model.path))
    if path == bundled.bundled_model_dir() and not bundled.is_prepared(path):
        logger.info("preparing the bundled model into %s (once)", path)
        bundled.prepare_bundled_model(path)
    if not path.is_dir():
        raise GenrunError(f"model path {path} does not exist; set actor_rollout_ref.model.path to a Hugging Face model directory")
    if not (path / "config.json").exists():
        raise GenrunError(
            f"model path {path} has no config.json; set actor_rollout_ref.model.path to a Hugging Face model directory "
            "(config.json, weights and tokenizer files, as save_pretrained or huggingface-cli download write it)"
        )
    if not any((path / name).exists() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        raise GenrunError(
            f"model path {path} has no tokenizer files (tokenizer.json / tokenizer_config.json); save the tokenizer "
            "there too (tokenizer.save_pretrained) or set actor_rollout_ref.model.path to a complete model directory"
        )
    return path


def _check_context(cfg: DictConfig, model_dir: Path) -> None:
    model_config = json.loads((model_dir / "config.json").read_text())
    context = model_config.get("max_position_embeddings")
    rollout = cfg.actor_rollout_ref.rollout
    if context and rollout.prompt_length + rollout.response_length > context:
        raise GenrunError(
            f"prompt_length {rollout.prompt_length} + response_length {rollout.response_length} exceed the model's "
            f"context of {context} tokens; lower data.max_prompt_length or data.max_response_length"
        )


def open_run_folder(folder: RunFolder, cfg: DictConfig, run_fingerprint: str, pad_token_id: int, shards: list[ShardSpec]) -> None:
    """Claim the folder for this run, or confirm it already belongs to it (resume)."""
    if folder.exists(RUN_FILE):
        existing = folder.read_json(RUN_FILE)
        if existing.get("fingerprint") != run_fingerprint:
            raise GenrunError(
                f"output folder {folder.display()} holds a different run (fingerprint {str(existing.get('fingerprint'))[:12]}, "
                f"this one is {run_fingerprint[:12]}): the config, dataset or versions changed (its config is in "
                f"{folder.display(RUN_FILE)}). Nothing was changed there. To start fresh, set another "
                "trainer.default_local_dir (or trainer.experiment_name, when that folder is derived from it) or delete that folder"
            )
        return
    folder.put_json(
        RUN_FILE,
        {
            "fingerprint": run_fingerprint,
            "versions": versions(),
            "pad_token_id": pad_token_id,
            "shards": [{"name": s.name, "range": [s.start, s.end]} for s in shards],
            "rollout_n": cfg.actor_rollout_ref.rollout.n,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            # storage.options can hold credentials: never written.
            "config": _config_without_secrets(cfg),
        },
    )


def _config_without_secrets(cfg: DictConfig) -> dict[str, Any]:
    container = OmegaConf.to_container(cfg, resolve=True)
    container["storage"]["options"] = redacted_options(container["storage"]["options"])
    engine_kwargs = container["actor_rollout_ref"]["rollout"]["engine_kwargs"]
    engine_kwargs["remote"] = redacted_options(engine_kwargs.get("remote") or {})
    return container


def check_run_code(cfg: DictConfig, prompts: PromptSet) -> None:
    """The user code a run calls, loaded once here so a broken piece stops the run before any
    model loads: agent loops (names, YAML, plugins), tools, reward function."""
    from generation_core.agent_loops import check_agent_loops, check_tools
    from generation_core.rewards import load_reward_function

    agent_names = prompts.agent_names()
    check_agent_loops(cfg, agent_names)
    check_tools(cfg, agent_names)
    load_reward_function(cfg)


def _code_hash(cfg: DictConfig) -> str:
    """Content of the user files that decide the output besides the dataset (reward function):
    editing them makes a different run, which must not resume into the old folder."""
    import hashlib

    digest = hashlib.sha256()
    reward_path = cfg.reward.custom_reward_function.path
    if reward_path and os.path.isfile(os.path.expanduser(reward_path)):
        digest.update(Path(os.path.expanduser(reward_path)).read_bytes())
    return digest.hexdigest()


def prepare_run(overrides: list[str]) -> RunPlan:
    # verl's loader, as AgentLoopWorker uses it: same pad token fallback, so merge pads like verl.
    from verl.utils import hf_tokenizer

    cfg = load_config(overrides)
    from generation_core.pool import check_rollout_name

    check_rollout_name(cfg)
    if cfg.actor_rollout_ref.rollout.name == "remote":
        from generation_core.engines.remote import check_servers

        # Servers that do not answer are found now, before Prefect, Ray or any shard starts.
        asyncio.run(check_servers(cfg))
    dataset_hash = check_prompt_files(cfg)
    model_dir = check_model_dir(cfg)
    _check_context(cfg, model_dir)
    run_fingerprint = fingerprint(cfg, f"{dataset_hash}:{_code_hash(cfg)}")
    finalize_run_location(cfg, run_fingerprint)
    tokenizer = hf_tokenizer(str(model_dir), trust_remote_code=cfg.actor_rollout_ref.model.trust_remote_code)
    prompts = PromptSet(cfg, tokenizer)
    shards = plan_shards(len(prompts), cfg.generation.num_shards)
    check_run_code(cfg, prompts)
    pad_token_id = tokenizer.pad_token_id
    folder = RunFolder(cfg.trainer.default_local_dir, OmegaConf.to_container(cfg.storage.options))
    folder.check_writable()
    open_run_folder(folder, cfg, run_fingerprint, pad_token_id, shards)
    return RunPlan(cfg, run_fingerprint, folder, prompts, shards, pad_token_id)


def ray_init_kwargs(cfg: DictConfig, run_fingerprint: str, forward_env: tuple[str, ...] = ()) -> dict[str, Any]:
    """ray.init arguments from `ray_kwargs.ray_init`, with safe single-host defaults."""
    # Single-host runs need no token auth; a cluster passes its own settings via ray_init.
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    init_kwargs = {k: v for k, v in OmegaConf.to_container(cfg.ray_kwargs.ray_init).items() if v is not None}
    if "address" not in init_kwargs:
        init_kwargs.setdefault("_node_ip_address", "127.0.0.1")
        if init_kwargs["_node_ip_address"] == "127.0.0.1" and not os.environ.get("RAY_ADDRESS"):
            _keep_ray_on_loopback()
        init_kwargs.setdefault("include_dashboard", False)
        # The object store takes 30% of RAM unless capped; we only pass small manifests through it.
        init_kwargs.setdefault("object_store_memory", 256 * 1024 * 1024)
    init_kwargs.setdefault("namespace", f"genrun-{run_fingerprint[:12]}")
    init_kwargs.setdefault("log_to_driver", os.environ.get("GENRUN_DEBUG") == "1")
    # Workers of an existing cluster were started without our environment: carry what they need.
    env_vars = {name: os.environ[name] for name in forward_env if name in os.environ}
    if env_vars:
        runtime_env = dict(init_kwargs.get("runtime_env") or {})
        runtime_env["env_vars"] = {**env_vars, **dict(runtime_env.get("env_vars") or {})}
        init_kwargs["runtime_env"] = runtime_env
    return init_kwargs


def _keep_ray_on_loopback() -> None:
    """On Linux, Ray replaces _node_ip_address=127.0.0.1 with the host's routable IP and its
    GCS, raylet and workers listen on every interface. Its single-machine mode (the default on
    macOS/Windows) keeps every server on 127.0.0.1: the driver reads the flag from this module,
    the processes Ray starts read it from the environment they inherit."""
    from ray._private import ray_constants

    os.environ[ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False


def start_ray(cfg: DictConfig, run_fingerprint: str, forward_env: tuple[str, ...] = ()) -> None:
    import ray

    if not ray.is_initialized():
        ray.init(**ray_init_kwargs(cfg, run_fingerprint, forward_env))


def boot_pool(cfg: DictConfig, balancer_name: str | None = None):
    """Boot the run's replicas (once per run) and return the pool; its owner tears it down."""
    from generation_core.pool import ReplicaPool

    return asyncio.run(ReplicaPool.boot(cfg, balancer_name))


# How long a shard worker waits for the driver to boot the replicas (SGLang on a large model
# takes minutes); the driver cancels its shard tasks at once when the boot fails.
POOL_BOOT_WAIT_SECONDS = 1800.0


def run_shard_job(config: dict[str, Any], shard_id: int, balancer_name: str, lease_generation: int | None = None) -> dict[str, Any]:
    """Run one shard in any process of the run's Ray job (a Prefect task on a Ray worker):
    attach to the booted pool by name, load the prompts, stream, commit, return the manifest.
    `lease_generation`: the run's lease on the folder; commits stop if a later run takes it."""
    from verl.utils import hf_tokenizer

    from generation_core.lease import LeaseFence

    from generation_core.pool import attach_client
    from generation_core.shard import run_shard

    cfg = OmegaConf.create(config)
    folder = RunFolder(cfg.trainer.default_local_dir, OmegaConf.to_container(cfg.storage.options))
    tokenizer = hf_tokenizer(os.path.expanduser(cfg.actor_rollout_ref.model.path), trust_remote_code=cfg.actor_rollout_ref.model.trust_remote_code)
    prompts = PromptSet(cfg, tokenizer)
    shard = plan_shards(len(prompts), cfg.generation.num_shards)[shard_id]
    client = attach_client(cfg, balancer_name)
    worker = build_streaming_worker(cfg, client, tokenizer, prompts)
    mark(f"shard_worker_ready {shard_id}")

    async def when_the_pool_is_up() -> dict[str, Any]:
        # The driver may still be loading the model: shard workers start beside it.
        await client.connect(wait_seconds=POOL_BOOT_WAIT_SECONDS)
        fence = LeaseFence(lease_generation) if lease_generation is not None else None
        try:
            return await run_shard(cfg, shard, folder, prompts, worker, fence)
        finally:
            await client.aclose()

    try:
        manifest = asyncio.run(when_the_pool_is_up())
        manifest["last_attempt"]["worker"] = _where_this_runs()
        mark(f"shard_done {shard_id}")
        return manifest
    finally:
        worker.shutdown()


def _where_this_runs() -> dict[str, Any]:
    """The Ray node and the GPUs this shard worker held (none: the replicas own the GPUs)."""
    import ray

    context = ray.get_runtime_context()
    return {"node_id": context.get_node_id(), "pid": os.getpid(), "gpu_ids": [str(g) for g in ray.get_gpu_ids()]}


def build_streaming_worker(cfg: DictConfig, llm_client, tokenizer, prompts: PromptSet):
    """A streaming worker for this process, with the run's reward function. The agent-loop check
    is the driver's preflight again: this process (a Ray worker) loads plugins and YAML itself."""
    from generation_core.agent_loops import check_agent_loops
    from generation_core.rewards import RewardScorer
    from generation_core.streaming import StreamingWorker

    check_agent_loops(cfg, prompts.agent_names())
    return StreamingWorker(cfg, llm_client, RewardScorer.from_config(cfg, tokenizer))


def merge_plan(plan: RunPlan):
    """Merge the run's committed parts as configured: one trajectories.pkl, or chunk files of at
    most generation.merge_chunk_size rows listed in trajectories.json. Returns a MergedOutput."""
    import numpy as np

    from generation_core.merge import MERGED_FILE, MergedOutput, merge_run, merge_run_chunked

    rollout = plan.cfg.actor_rollout_ref.rollout
    lengths = dict(prompt_length=rollout.prompt_length, response_length=rollout.response_length, pad_token_id=plan.pad_token_id)
    chunk_size = plan.cfg.generation.merge_chunk_size
    if chunk_size is not None:
        return merge_run_chunked(plan.folder, chunk_size=chunk_size, **lengths)
    data = merge_run(plan.folder, **lengths)
    return MergedOutput(MERGED_FILE, len(data), np.array([m.get("generate_sequences", 0.0) for m in data.meta_info["metrics"]]))


async def _generate(plan: RunPlan, fence) -> list[dict[str, Any]]:
    from generation_core.pool import ReplicaPool
    from generation_core.shard import run_shard

    pool = await ReplicaPool.boot(plan.cfg)
    worker = None
    client = pool.client()
    try:
        worker = build_streaming_worker(plan.cfg, client, plan.prompts.dataset.tokenizer, plan.prompts)
        return [await run_shard(plan.cfg, shard, plan.folder, plan.prompts, worker, fence) for shard in plan.shards]
    finally:
        if worker is not None:
            worker.shutdown()
        await client.aclose()
        pool.shutdown()


def execute_run(plan: RunPlan) -> dict[str, Any]:
    """Generate every missing trajectory, merge, and return the run summary."""
    from generation_core.publish import publish_run

    from generation_core.lease import RunLease

    started = time.perf_counter()
    with RunLease.acquire(plan.folder, plan.cfg.generation.lease_seconds) as lease:
        start_ray(plan.cfg, plan.fingerprint)
        manifests = asyncio.run(_generate(plan, lease.fence()))
        summary = finish_run(plan, manifests, time.perf_counter() - started)
        summary["published"] = publish_run(plan.cfg, plan.folder, summary)
    return summary


def finish_run(plan: RunPlan, manifests: list[dict[str, Any]], elapsed: float) -> dict[str, Any]:
    """Merge (when configured) and write the run's manifest.json; returns the summary."""
    from generation_core.publish import latency_percentiles

    summary = summarize(plan, manifests, elapsed)
    if plan.cfg.generation.final_merge:
        merged = merge_repairing(plan.folder, lambda: merge_plan(plan))
        summary["artifact"] = plan.folder.display(merged.entry_file)
        summary["merged_rows"] = merged.rows
        summary["request_latency_s"] = latency_percentiles(merged.generate_seconds)
    plan.folder.put_json(MANIFEST_FILE, summary)
    return summary


def merge_repairing(folder: RunFolder, merge):
    """Run `merge`; a part it finds damaged is dropped from its shard's checkpoint, so that
    running the same command again regenerates exactly its samples, and the error says so."""
    from generation_core.part_integrity import DamagedPart, mark_for_repair

    try:
        return merge()
    except DamagedPart as damaged:
        mark_for_repair(folder, damaged)
        raise GenrunError(f"{damaged}; its samples were dropped from the shard's checkpoint: run the same command again to regenerate them and merge") from None


def summarize(plan: RunPlan, manifests: list[dict[str, Any]], elapsed: float) -> dict[str, Any]:
    generated_now = sum(m["last_attempt"]["trajectories"] for m in manifests)
    shard_seconds = sum(m["last_attempt"]["seconds"] for m in manifests)
    tokens_now = sum(m["last_attempt"]["generated_tokens"] for m in manifests)
    return {
        "fingerprint": plan.fingerprint,
        "output": plan.folder.display(),
        "num_trajectories": sum(m["num_trajectories"] for m in manifests),
        "generated_tokens": sum(m["generated_tokens"] for m in manifests),
        "failed_samples": sum(m.get("failures", 0) for m in manifests),
        # Prompts verl's dataset dropped as longer than data.max_prompt_length: never generated.
        "filtered_overlong_prompts": plan.prompts.filtered_overlong,
        "replica_failures": sum(m["last_attempt"].get("engine", {}).get("replica_failures", 0) for m in manifests),
        # Damaged parts found over the run's life, dropped and regenerated (part_integrity).
        "repaired_parts": [dict(repair, shard=m["shard"]) for m in manifests for repair in m.get("repaired_parts", [])],
        "this_invocation": {
            "trajectories": generated_now,
            "generated_tokens": tokens_now,
            "generation_seconds": round(shard_seconds, 3),
            "tokens_per_second": round(tokens_now / shard_seconds, 2) if shard_seconds else 0.0,
            "wall_seconds": round(elapsed, 3),
        },
        "shards": [shard_stats(m) for m in manifests],
    }


def shard_stats(manifest: dict[str, Any]) -> dict[str, Any]:
    """One row of the per-shard table (Prefect artifact, manifest.json)."""
    last = manifest.get("last_attempt", {})
    seconds = last.get("seconds", 0.0)
    return {
        "shard": manifest["shard"],
        "samples": manifest["num_trajectories"],
        "tokens": manifest["generated_tokens"],
        "tokens_per_s": round(last.get("generated_tokens", 0) / seconds, 2) if seconds else 0.0,
        "failures": manifest.get("failures", 0),
        "attempts": manifest.get("attempts", 1),
        "retries": max(manifest.get("attempts", 1) - 1, 0),
    }
