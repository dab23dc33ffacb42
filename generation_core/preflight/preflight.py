"""Preflight: every check that needs no model, and the shard plan, once per command.

`preflight(overrides)` loads and validates the config, checks the engine (and that remote
servers answer), the dataset files (from metadata: footers, one nested column, a tokenized
sample of prompts), the model folder, the user code a run calls (agent loops, tools, reward
function) and the output folder, and plans the shards as ranges of raw rows. A wrong input is
refused in seconds with one line, before Prefect, Ray or a model start, and nothing is written.
The result, a `RunPlan` (generation_core/run_plan.py), is plain data that crosses process boundaries
whole, as one JSON text (`to_json` / `from_json`): the CLI hands it to the flow, the flow to every
Prefect task, and nobody plans again.

The run fingerprint (generation_core/preflight/fingerprint.py) is computed here, once the inputs are
checked.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from omegaconf import DictConfig, OmegaConf

from generation_core.build import other_build_warning
from generation_core.config import bundled
from generation_core.config.layout import REMOTE_ENGINE, check_engine_installed
from generation_core.config.loading import finalize_run_location, load_config
from generation_core.config.settings import GenerationSettings
from generation_core.engines.remote import check_servers
from generation_core.errors import GenrunError
from generation_core.inputs.agent_loops import check_agent_loops, check_tools
from generation_core.inputs.dataset_files import DatasetInspection, inspect_dataset
from generation_core.inputs.task_build import resolve_train_tasks, tasks_digest
from generation_core.inputs.tokenizer import run_tokenizer, tokenizer_dir
from generation_core.preflight.fingerprint import fingerprint_and_model
from generation_core.run_plan import RunPlan, plan_shards
from generation_core.secrets import keep_in_environment, split_secrets
from generation_core.shard.rewards import load_reward_function
from generation_core.store.folder import StorageFolder
from generation_core.store.run_folder import check_run_folder

logger = logging.getLogger(__name__)


def check_model_dir(cfg: DictConfig) -> Path:
    path = Path(os.path.expanduser(cfg.actor_rollout_ref.model.path))
    if path == bundled.bundled_model_dir() and not bundled.is_prepared(path):
        logger.info("preparing the bundled model into %s (once)", path)
        bundled.prepare_bundled_model(path)
    if path.exists() and not path.is_dir():
        raise GenrunError(
            f"model path {path} is a file, not a model directory; set actor_rollout_ref.model.path to the Hugging Face "
            "model directory (the folder holding config.json, the weights and the tokenizer files)"
        )
    if not path.is_dir():
        raise GenrunError(
            f"model path {path} does not exist; set actor_rollout_ref.model.path to a Hugging Face model directory"
        )
    if not (path / "config.json").exists():
        raise GenrunError(
            f"model path {path} has no config.json; set actor_rollout_ref.model.path to a Hugging Face model directory "
            "(config.json, weights and tokenizer files, as save_pretrained or huggingface-cli download write it)"
        )
    tokenizer = Path(tokenizer_dir(cfg.actor_rollout_ref.model))
    if not any((tokenizer / name).exists() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        where = "tokenizer_path" if tokenizer != path else "path"
        raise GenrunError(
            f"actor_rollout_ref.model.{where} {tokenizer} has no tokenizer files "
            "(tokenizer.json / tokenizer_config.json); save the tokenizer there (tokenizer.save_pretrained), or set "
            "actor_rollout_ref.model.tokenizer_path to a folder that has them"
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


def check_run_code(cfg: DictConfig, agent_names: set[str]) -> None:
    """The user code a run calls, loaded once here so a broken piece stops the run before any
    model loads: agent loops (names, YAML, plugins), tools, reward function. `agent_names`: every
    agent loop the dataset's rows ask for."""
    check_agent_loops(cfg, agent_names)
    check_tools(cfg, agent_names)
    load_reward_function(cfg)


@dataclass
class CheckedInputs:
    """What the light half of preflight found: the config, the dataset, the model folder and the
    run's fingerprint and folder (no engine stack imported yet)."""

    cfg: DictConfig
    dataset: DatasetInspection
    model_dir: Path
    fingerprint: str | None
    """None while user code the fingerprint walks does not load (plan_run refuses it)."""
    model_digest: str | None
    served_model: str | None = None
    tasks: str | None = None


def preflight(overrides: list[str]) -> RunPlan:
    """Check every input and plan the run from the dataset's metadata (no prompt is tokenized but
    a sample: each shard filters its own rows)."""
    return plan_run(check_inputs(overrides))


def check_inputs(overrides: list[str]) -> CheckedInputs:
    """The checks that need no engine stack (config, remote servers, tasks, dataset files, model
    folder) and the run's fingerprint and folder: a typo or a missing file is refused at once, and
    a finished run is recognised before verl, torch or Ray load (driver/finished_run.py)."""
    cfg = load_config(overrides)
    served_model = None
    if cfg.actor_rollout_ref.rollout.name == REMOTE_ENGINE:
        # Servers that do not answer are found now, before Prefect, Ray or any shard starts.
        served = asyncio.run(check_servers(cfg))
        # The model they serve (one: check_servers refuses a mix) shapes the output, also when
        # engine_kwargs.remote.model is null.
        served_model = next(iter(served.values()))
    # Tasks become data.train_files before anything reads the dataset.
    built_tasks = resolve_train_tasks(cfg, str(bundled.BUNDLED_PROMPTS))
    dataset = inspect_dataset(cfg)
    model_dir = check_model_dir(cfg)
    _check_context(cfg, model_dir)
    tasks = tasks_digest(built_tasks) if built_tasks else None
    try:
        fingerprint, model_digest = fingerprint_and_model(cfg, dataset.digest, served_model, tasks)
    except GenrunError:
        raise
    except Exception as exc:  # noqa: BLE001 - the user's code (an agent loop, a tool) that does not load
        # Its refusal, in one line naming the key, comes from check_run_code in plan_run; until
        # then this run has no fingerprint (and no finished folder to recognise).
        logger.debug("fingerprint deferred: %s: %s", type(exc).__name__, exc)
        return CheckedInputs(cfg, dataset, model_dir, None, None, served_model, tasks)
    finalize_run_location(cfg, fingerprint)
    return CheckedInputs(cfg, dataset, model_dir, fingerprint, model_digest, served_model, tasks)


def plan_run(inputs: CheckedInputs) -> RunPlan:
    """The checks that load the engine stack, the tokenizer and the user's code, then the plan. The
    output folder is checked first, while the engine stack is not imported yet (seconds of CPU)."""
    cfg, dataset = inputs.cfg, inputs.dataset
    check_engine_installed(cfg.actor_rollout_ref.rollout.name)
    if inputs.fingerprint is not None:
        _check_output_folder(cfg, inputs.fingerprint)

    # Where this run starts Ray on this machine: its GPUs and CPUs hold the replicas (Ray's
    # import only, before the engine stack's).
    from generation_core.serving.ray_setup import check_replicas_fit

    check_replicas_fit(cfg)

    from generation_core.inputs.shard_rows import check_overlong_sample

    # verl's loader and folder, as AgentLoopWorker uses them: same pad token fallback, so the merge pads like verl.
    tokenizer = run_tokenizer(cfg.actor_rollout_ref.model)
    check_overlong_sample(cfg, dataset.files, tokenizer)
    shards = plan_shards(dataset.files.num_rows, GenerationSettings.of(cfg).num_shards)
    default_loop = cfg.actor_rollout_ref.rollout.agent.default_agent_loop
    check_run_code(cfg, {name or default_loop for name in dataset.agent_names})
    fingerprint, model_digest = inputs.fingerprint, inputs.model_digest
    if fingerprint is None:
        fingerprint, model_digest = fingerprint_and_model(cfg, dataset.digest, inputs.served_model, inputs.tasks)
        finalize_run_location(cfg, fingerprint)
        _check_output_folder(cfg, fingerprint)
    plan = RunPlan(cfg, fingerprint, shards, tokenizer.pad_token_id, dataset.files, model_digest=model_digest)
    # Before Ray starts: its runtime env carries them to the run's workers, nothing stores them.
    keep_in_environment(split_secrets(OmegaConf.to_container(cfg, resolve=True))[1])
    return plan


def _check_output_folder(cfg: DictConfig, fingerprint: str) -> None:
    """The run's folder (RunPlan.folder) can be written (a missing bucket, a file in the way) and
    holds no other run; run.json itself is written under the lease."""
    folder = StorageFolder(
        cfg.trainer.default_local_dir, cast(dict[str, Any], OmegaConf.to_container(cfg.storage.options))
    )
    # The write probe creates a local folder and its parents: a run refused by a later check
    # leaves none of them behind (the lease creates the folder when the run starts).
    created = []
    if folder.is_local:
        missing = Path(folder.root)
        while not missing.exists() and missing.parent != missing:
            created.append(missing)
            missing = missing.parent
    try:
        folder.check_writable()
    finally:
        for path in created:  # the deepest first; only empty folders go
            with contextlib.suppress(OSError):
                path.rmdir()
    existing = check_run_folder(folder, fingerprint)
    if existing is not None:
        warning = other_build_warning(folder.display(), existing.build)
        if warning:
            logger.warning(warning)
