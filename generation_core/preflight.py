"""Preflight: every check that needs no model, and the shard plan, once per command.

`preflight(overrides)` loads and validates the config, checks the engine (and that remote
servers answer), the dataset files (from metadata: footers, one nested column, a tokenized
sample of prompts), the model folder, the user code a run calls (agent loops, tools, reward
function) and the output folder, and plans the shards as ranges of raw rows. A wrong input is
refused in seconds with one line, before Prefect, Ray or a model start, and nothing is written.
The result, a `RunPlan` (generation_core/plan.py), is plain data that crosses process boundaries
(`to_dict` / `from_dict`): the CLI hands it to the flow, the flow hands each shard job its
`ShardSpec` and the dataset's description (`DatasetFiles`), and nobody plans again.

The run fingerprint is computed here, once the inputs are checked: the config's output keys
plus digests of the files config.OUTPUT_FILES declares (dataset, model, reward function, agent
loops, tools) and, for remote servers, the model they serve.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import struct
import sys
from pathlib import Path
from typing import cast

import hydra
from omegaconf import DictConfig, ListConfig, OmegaConf
from verl.utils import hf_tokenizer

from generation_core import bundled
from generation_core.agent_loops import check_agent_loops, check_tools, existing_config_file, plugin_entry_points
from generation_core.build import other_build_warning
from generation_core.code_inputs import CodeWalk
from generation_core.config import OUTPUT_FILES, finalize_run_location, fingerprint, load_config
from generation_core.data import check_overlong_sample, plan_shards
from generation_core.dataset_files import inspect_dataset
from generation_core.engines.layout import REMOTE_ENGINE
from generation_core.engines.remote import check_servers
from generation_core.errors import GenrunError
from generation_core.plan import RunPlan, versions
from generation_core.pool import check_rollout_name
from generation_core.rewards import load_reward_function
from generation_core.run_folder import check_run_folder
from generation_core.secrets import keep_in_environment, split_secrets

logger = logging.getLogger(__name__)


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


def check_run_code(cfg: DictConfig, agent_names: set[str]) -> None:
    """The user code a run calls, loaded once here so a broken piece stops the run before any
    model loads: agent loops (names, YAML, plugins), tools, reward function. `agent_names`: every
    agent loop the dataset's rows ask for."""
    check_agent_loops(cfg, agent_names)
    check_tools(cfg, agent_names)
    load_reward_function(cfg)


# ---- the fingerprint's file inputs (config.OUTPUT_FILES) -------------------------------------

# Model identity. A full hash of the weights costs minutes per command on a multi-GB model
# (140 GB at ~1 GB/s), and modification times change on every copy, so neither is used. Read
# instead: every small file whole (config.json, generation_config.json, tokenizer and chat
# template, the safetensors index, remote code), each weight file's size, a safetensors file's
# header (every tensor's name, dtype, shape and offsets) and WEIGHT_SLICE_BYTES from the middle
# of every tensor; other weight formats (.bin, .gguf, ...) give WEIGHT_SAMPLES evenly spaced
# slices. Another checkpoint (a training step, a merged LoRA, another dtype or vocabulary)
# changes each tensor it touches nearly everywhere, so it is told apart for about 4 KiB read per
# tensor; what it misses is an edit of a few values outside the slices read.
WEIGHT_SLICE_BYTES = 4096
WEIGHT_SAMPLES = 64
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".onnx", ".npz")
WHOLE_FILE_LIMIT = 64 << 20


def model_identity(model_dir: Path) -> str:
    """A digest of a model folder's files that tells one model (or checkpoint) from another
    without reading its weights whole; see WEIGHT_SLICE_BYTES for what it reads."""
    digest = hashlib.sha256()
    # The folder's own files; hidden ones (a download tool's .cache/ metadata) are not the model.
    for path in sorted(p for p in model_dir.iterdir() if p.is_file() and not p.name.startswith(".")):
        size = path.stat().st_size
        digest.update(f"{path.name}\0{size}\0".encode())
        if path.suffix == ".safetensors":
            _safetensors_identity(path, size, digest)
        elif path.suffix in WEIGHT_SUFFIXES or size > WHOLE_FILE_LIMIT:
            _sampled_identity(path, size, digest)
        else:
            digest.update(path.read_bytes())
    return digest.hexdigest()


def _safetensors_identity(path: Path, size: int, digest) -> None:
    with open(path, "rb") as f:
        header_len = struct.unpack("<Q", f.read(8))[0] if size >= 8 else size
        if header_len > size - 8:
            raise GenrunError(f"{path} is not a safetensors file (its header length {header_len} exceeds the file); fix or remove it from actor_rollout_ref.model.path")
        header = f.read(header_len)
        digest.update(header)
        try:
            tensors = json.loads(header)
        except ValueError:
            raise GenrunError(f"{path} is not a safetensors file (its header is not JSON); fix or remove it from actor_rollout_ref.model.path") from None
        data_start = 8 + header_len
        for name in sorted(k for k in tensors if k != "__metadata__"):
            begin, end = tensors[name]["data_offsets"]
            f.seek(data_start + begin + max(end - begin - WEIGHT_SLICE_BYTES, 0) // 2)
            digest.update(f.read(min(WEIGHT_SLICE_BYTES, end - begin)))


def _sampled_identity(path: Path, size: int, digest) -> None:
    with open(path, "rb") as f:
        for sample in range(WEIGHT_SAMPLES):
            f.seek(size * sample // WEIGHT_SAMPLES)
            digest.update(f.read(WEIGHT_SLICE_BYTES))


def _agent_loops_digest(path: str) -> str:
    """The agent-loop YAML and the source files of the classes it names (check_run_code has
    imported them)."""
    resolved = existing_config_file("actor_rollout_ref.rollout.agent.agent_loop_config_path", path)
    digest = hashlib.sha256(Path(resolved).read_bytes())
    sources = set()
    for entry in cast(ListConfig, OmegaConf.load(resolved)):  # a list of loops
        module = sys.modules.get(hydra.utils.get_class(entry._target_).__module__)
        source = getattr(module, "__file__", None)
        if source and os.path.isfile(source):
            sources.add(source)
    for source in sorted(sources):
        digest.update(Path(source).read_bytes())
    return digest.hexdigest()


def user_code_digest(cfg: DictConfig) -> str | None:
    """The user code the run calls beyond the files OUTPUT_FILES hashes (code_inputs.CodeWalk):
    the local modules the reward file, function tools and custom dataset class import, and the
    modules of the tool classes, agent-loop classes and `verl.plugins` entry points. None when
    there is none. check_run_code has imported them (their files are read from sys.modules)."""
    walk = CodeWalk(already_versioned=versions())
    for key in ("reward.custom_reward_function.path", "actor_rollout_ref.rollout.multi_turn.function_tool_path", "data.custom_cls.path"):
        path = OmegaConf.select(cfg, key)
        if path and os.path.isfile(os.path.expanduser(path)):
            walk.add_file(os.path.expanduser(path))
    tool_config = cfg.actor_rollout_ref.rollout.multi_turn.tool_config_path
    if tool_config:
        tools = cast(DictConfig, OmegaConf.load(existing_config_file("actor_rollout_ref.rollout.multi_turn.tool_config_path", tool_config))).get("tools") or []
        for tool in tools:
            if isinstance(tool, DictConfig) and isinstance(tool.get("class_name"), str):
                walk.add_module(tool.class_name.rpartition(".")[0], named=True)
    loops = cfg.actor_rollout_ref.rollout.agent.agent_loop_config_path
    if loops:
        for entry in cast(ListConfig, OmegaConf.load(existing_config_file("actor_rollout_ref.rollout.agent.agent_loop_config_path", loops))):
            walk.add_module(entry._target_.rpartition(".")[0], named=True)
    for entry_point in plugin_entry_points():
        walk.add_entry_point(entry_point)
    return walk.found.digest()


def output_file_digests(cfg: DictConfig) -> dict[str, str]:
    """Digests of the files config.OUTPUT_FILES declares, by config key (the dataset's is
    dataset_files.inspect_dataset's), and of the user code they reach (`user code`); a key left
    unset is absent."""
    digests = {}
    for key, kind in OUTPUT_FILES.items():
        path = OmegaConf.select(cfg, key)
        if not path or kind == "dataset":
            continue
        if kind == "model":
            # A tokenizer_path may name a hub repository instead of a folder: its name is the identity.
            if Path(os.path.expanduser(path)).is_dir():
                digests[key] = model_identity(Path(os.path.expanduser(path)))
        elif kind == "agent_loops":
            digests[key] = _agent_loops_digest(path)
        else:
            digests[key] = hashlib.sha256(Path(existing_config_file(key, os.path.expanduser(path))).read_bytes()).hexdigest()
    code = user_code_digest(cfg)
    if code is not None:
        digests["user code"] = code
    return digests


def preflight(overrides: list[str]) -> RunPlan:
    """Check every input and plan the run from the dataset's metadata (no prompt is tokenized but
    a sample: each shard filters its own rows)."""
    cfg = load_config(overrides)
    check_rollout_name(cfg)
    files = {}
    if cfg.actor_rollout_ref.rollout.name == REMOTE_ENGINE:
        # Servers that do not answer are found now, before Prefect, Ray or any shard starts.
        served = asyncio.run(check_servers(cfg))
        # The model they serve (one: check_servers refuses a mix) shapes the output, also when
        # engine_kwargs.remote.model is null.
        files["served model"] = next(iter(served.values()))
    dataset = inspect_dataset(cfg)
    model_dir = check_model_dir(cfg)
    _check_context(cfg, model_dir)
    # verl's loader, as AgentLoopWorker uses it: same pad token fallback, so the merge pads like verl.
    tokenizer = hf_tokenizer(str(model_dir), trust_remote_code=cfg.actor_rollout_ref.model.trust_remote_code)
    check_overlong_sample(cfg, dataset.files, tokenizer)
    shards = plan_shards(dataset.files.num_rows, cfg.generation.num_shards)
    default_loop = cfg.actor_rollout_ref.rollout.agent.default_agent_loop
    check_run_code(cfg, {name or default_loop for name in dataset.agent_names})
    files.update(output_file_digests(cfg))
    run_fingerprint = fingerprint(cfg, dataset.digest, files)
    finalize_run_location(cfg, run_fingerprint)
    plan = RunPlan(cfg, run_fingerprint, shards, tokenizer.pad_token_id, dataset.files)
    # Before Ray starts: its runtime env carries them to the run's workers, nothing stores them.
    keep_in_environment(split_secrets(OmegaConf.to_container(cfg, resolve=True))[1])
    plan.folder.check_writable()
    # Refused here when the folder holds another run; run.json itself is written under the lease.
    existing = check_run_folder(plan.folder, run_fingerprint)
    if existing is not None:
        warning = other_build_warning(plan.folder.display(), existing.build)
        if warning:
            logger.warning(warning)
    return plan
