"""The run fingerprint, whole: which config keys and files shape a run's trajectories, the
digests of those files, and the hash over them.

A run folder belongs to one fingerprint (run.json); the same command computes the same one and
resumes there, and anything that would change the trajectories changes it. Its pieces, in one
place: `operational_keys` (config keys left out), OUTPUT_FILES (config keys whose files enter by
content), the file digests (`output_file_digests`: the model by `model_identity`, the agent
loops with their classes' source, the user code `code_inputs.CodeWalk` finds), the versions of
the code that produces trajectories (plan.versions) and genrun's output format
(build.OUTPUT_FORMAT_VERSION). `run_fingerprint` puts them together for preflight, once the
inputs are checked. The recipe's version, which run.json records, is
run_folder.FOLDER_FORMAT: bump it when this module's rules change.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import sys
from pathlib import Path
from typing import cast

import hydra
from omegaconf import DictConfig, ListConfig, OmegaConf

from generation_core.build import OUTPUT_FORMAT_VERSION
from generation_core.config.checks import operational_keys as declared_operational_keys
from generation_core.config.settings import DECLARED
from generation_core.errors import GenrunError
from generation_core.inputs.agent_loops import existing_config_file, plugin_entry_points
from generation_core.inputs.task_build import task_configs
from generation_core.inputs.user_code import CodeWalk
from generation_core.run_plan import versions

# Output-shaping: every config key that `operational_keys` does not list (engine and sampling
# settings, lengths, the agent loop, reward, data and shard settings, and any key a user adds),
# and the content of the files that OUTPUT_FILES lists. A key nobody classified counts as
# output-shaping: forgetting one costs a new folder, never someone else's trajectories.
# Operational: how the run executes (threads, timeouts, retries, workers, progress, logging,
# storage, where the servers are); a resumed run may change them. genrun's own keys say which
# they are where they are declared (`shapes_output`, settings.DECLARED); verl's are listed here.

OPERATIONAL_KEYS = (
    "trainer.default_local_dir",
    "trainer.experiment_name",
    "trainer.project_name",
    "trainer.logger",
    "data.dataloader_num_workers",
    "data.filter_overlong_prompts_workers",
    "actor_rollout_ref.rollout.max_num_seqs",
    # Tokens one engine step may run: which requests share a step (scheduling, as max_num_seqs).
    "actor_rollout_ref.rollout.max_num_batched_tokens",
    "actor_rollout_ref.rollout.gpu_memory_utilization",
    # How sglang/vllm read model.path (auto, safetensors, pt: the same weights). dummy, random
    # weights, is refused (config/layout.py), so every value left loads the checkpoint.
    "actor_rollout_ref.rollout.load_format",
    "actor_rollout_ref.rollout.agent.num_workers",
    # A metrics label (verl fills it with the model path, whose content is an input already).
    "actor_rollout_ref.rollout.prometheus.served_model_name",
    "storage",
    # How to reach the input files (endpoint, credentials); their content is in the fingerprint.
    "data.storage_options",
    # Where built tasks are cached; the built files enter by content (data.train_tasks below).
    "data.task_cache_dir",
    "ray_kwargs",
)


def operational_keys() -> tuple[str, ...]:
    """Every key left out of the fingerprint: OPERATIONAL_KEYS, and each declared key of genrun's
    own sections that does not shape output."""
    declared = (key for section, cls in DECLARED.items() for key in declared_operational_keys(section, cls))
    return (*OPERATIONAL_KEYS, *declared)


OUTPUT_FILES = {
    "data.train_files": "dataset",
    "actor_rollout_ref.model.path": "model",
    "actor_rollout_ref.model.tokenizer_path": "model",
    "reward.custom_reward_function.path": "file",
    "data.custom_cls.path": "file",
    "actor_rollout_ref.rollout.agent.agent_loop_config_path": "agent_loops",
    "actor_rollout_ref.rollout.multi_turn.tool_config_path": "file",
    "actor_rollout_ref.rollout.multi_turn.function_tool_path": "file",
    # verl's older place for the tool config (load_config copies it to multi_turn).
    "data.tool_config_path": "file",
    # Built by preflight (inputs/tasks.py); run_fingerprint receives their digest.
    "data.train_tasks": "tasks",
}
"""Config keys naming files whose content shapes the output, and how output_file_digests reads them:
`dataset` (dataset_files.inspect_dataset: metadata plus a sampled content hash), `model` (model_identity: config,
tokenizer and weights), `file` (content), `agent_loops` (the YAML and the source files of the
classes it names). Their content stands in for their path in the fingerprint."""


# ---- the digests of the files OUTPUT_FILES declares -------------------------------------------

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
            raise GenrunError(
                f"{path} is not a safetensors file (its header length {header_len} exceeds the file); fix or remove it from actor_rollout_ref.model.path"
            )
        header = f.read(header_len)
        digest.update(header)
        try:
            tensors = json.loads(header)
        except ValueError:
            raise GenrunError(
                f"{path} is not a safetensors file (its header is not JSON); fix or remove it from actor_rollout_ref.model.path"
            ) from None
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
    for key in (
        "reward.custom_reward_function.path",
        "actor_rollout_ref.rollout.multi_turn.function_tool_path",
        "data.custom_cls.path",
    ):
        path = OmegaConf.select(cfg, key)
        if path and os.path.isfile(os.path.expanduser(path)):
            walk.add_file(os.path.expanduser(path))
    for task in task_configs(cfg):
        # A task's custom class (inputs/tasks.py): the local modules its file imports.
        if task.custom_cls and os.path.isfile(os.path.expanduser(task.custom_cls["path"])):
            walk.add_file(os.path.expanduser(task.custom_cls["path"]))
    tool_config = cfg.actor_rollout_ref.rollout.multi_turn.tool_config_path
    if tool_config:
        tools = (
            cast(
                DictConfig,
                OmegaConf.load(
                    existing_config_file("actor_rollout_ref.rollout.multi_turn.tool_config_path", tool_config)
                ),
            ).get("tools")
            or []
        )
        for tool in tools:
            if isinstance(tool, DictConfig) and isinstance(tool.get("class_name"), str):
                walk.add_module(tool.class_name.rpartition(".")[0], named=True)
    loops = cfg.actor_rollout_ref.rollout.agent.agent_loop_config_path
    if loops:
        for entry in cast(
            ListConfig,
            OmegaConf.load(existing_config_file("actor_rollout_ref.rollout.agent.agent_loop_config_path", loops)),
        ):
            walk.add_module(entry._target_.rpartition(".")[0], named=True)
    for entry_point in plugin_entry_points():
        walk.add_entry_point(entry_point)
    return walk.found.digest()


def output_file_digests(cfg: DictConfig) -> dict[str, str]:
    """Digests of the files OUTPUT_FILES declares, by config key (the dataset's is
    dataset_files.inspect_dataset's), and of the user code they reach (`user code`); a key left
    unset is absent."""
    digests = {}
    for key, kind in OUTPUT_FILES.items():
        path = OmegaConf.select(cfg, key)
        if not path or kind in ("dataset", "tasks"):
            continue
        if kind == "model":
            # A tokenizer_path may name a hub repository instead of a folder: its name is the identity.
            if Path(os.path.expanduser(path)).is_dir():
                digests[key] = model_identity(Path(os.path.expanduser(path)))
        elif kind == "agent_loops":
            digests[key] = _agent_loops_digest(path)
        else:
            digests[key] = hashlib.sha256(
                Path(existing_config_file(key, os.path.expanduser(path))).read_bytes()
            ).hexdigest()
    code = user_code_digest(cfg)
    if code is not None:
        digests["user code"] = code
    return digests


def fingerprint(cfg: DictConfig, dataset_hash: str, files: dict[str, str] | None = None) -> str:
    """Hash of everything that determines the output: the config minus `operational_keys`, the
    dataset content, the digests of the other OUTPUT_FILES (by config key, as output_file_digests computes
    them, with the user code they reach), the versions of the code that produces it and genrun's
    output format (build.OUTPUT_FORMAT_VERSION). A file given by its digest enters by
    its content, not its path: the same model or dataset elsewhere (another machine's cache, a
    copy) is the same run."""
    files = dict(files or {})
    semantic = OmegaConf.to_container(cfg, resolve=True)
    by_content = [key for key, kind in OUTPUT_FILES.items() if kind == "dataset" or key in files]
    for key in (*operational_keys(), *by_content):
        parent, _, leaf = key.rpartition(".")
        node = semantic
        for part in parent.split(".") if parent else []:
            node = node.get(part) or {} if isinstance(node, dict) else {}
        if isinstance(node, dict):
            node.pop(leaf, None)
    # output_format: genrun's own output format (build.py states the rule).
    inputs = {
        "config": semantic,
        "dataset": dataset_hash,
        "files": files,
        "versions": versions(),
        "output_format": OUTPUT_FORMAT_VERSION,
    }
    payload = json.dumps(inputs, sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()


def run_fingerprint(
    cfg: DictConfig, dataset_digest: str, served_model: str | None = None, tasks: str | None = None
) -> str:
    """The fingerprint of a checked run: its config, the dataset's digest
    (dataset_files.inspect_dataset), the digests of its other files and user code, for
    remote servers the model they serve (also when engine_kwargs.remote.model is null), and for
    `data.train_tasks` the digest of the built files and the task classes' source
    (inputs.task_build.tasks_digest), which stands in for the tasks' config."""
    return fingerprint_and_model(cfg, dataset_digest, served_model, tasks)[0]


def fingerprint_and_model(
    cfg: DictConfig, dataset_digest: str, served_model: str | None = None, tasks: str | None = None
) -> tuple[str, str | None]:
    """`run_fingerprint`, and the model's digest it took (the served model for remote servers;
    None for a model given by hub name): what each trajectory's provenance names."""
    files = {"served model": served_model} if served_model is not None else {}
    if tasks is not None:
        files["data.train_tasks"] = tasks
    files.update(output_file_digests(cfg))
    return fingerprint(cfg, dataset_digest, files), files.get("actor_rollout_ref.model.path", served_model)
