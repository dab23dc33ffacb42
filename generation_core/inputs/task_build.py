"""`data.train_tasks` built into Parquet prompt files (a task and its rows: tasks.py).

Preflight (preflight/preflight.py) resolves the tasks into `data.train_files` before anything else
reads the dataset: each task's rows, in verl's RL layout (`data_source`, the prompt column,
`ability`, `reward_model`, `extra_info` with a unique `index`), are written once as Parquet under
`data.task_cache_dir`, named by the hash of the task's config, code and input files
(inputs/task_cache.py), and reused while all stay the same. Several tasks make several files,
indexed one after another, in one schema. Every task's class loads before anything is built.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import logging
import os
from dataclasses import dataclass
from typing import Any, cast

import pyarrow as pa
import pyarrow.parquet as pq
from omegaconf import DictConfig, OmegaConf

from generation_core.errors import GenrunError
from generation_core.inputs.dataset_location import data_storage_options
from generation_core.inputs.task_cache import cached_parquet, log_hub_build, task_code_digest
from generation_core.inputs.tasks import BadRow, Task, TaskConfig, load_task_class
from generation_core.store.folder import StorageFolder

logger = logging.getLogger(__name__)

TASKS_KEY = "data.train_tasks"
DEFAULT_CACHE_DIR = "~/.cache/genrun/tasks"


@dataclass(frozen=True)
class BuiltTask:
    """A task's Parquet file in the cache, its sha256 and the digest of the code that built it
    (both for the fingerprint), and its row count."""

    url: str
    sha256: str
    code_hash: str
    num_rows: int


def tasks_digest(built: list[BuiltTask]) -> str:
    """One digest of the built files and the tasks' code, for the run fingerprint."""
    return hashlib.sha256(json.dumps([[task.sha256, task.code_hash] for task in built]).encode()).hexdigest()


def task_configs(cfg: DictConfig) -> list[TaskConfig]:
    """The tasks of `data.train_tasks` (a list, or a YAML file listing them), each checked; none
    when it is unset. Set to no task at all (`[]`, an empty file, every entry commented out) is
    refused: the run would read `data.train_files`, by default the bundled demo prompts."""
    raw = OmegaConf.select(cfg, TASKS_KEY)
    if raw is None:
        return []
    named = f"{TASKS_KEY}={raw!r}" if isinstance(raw, str) else TASKS_KEY
    if isinstance(raw, str):
        # A YAML file that lists the tasks (easier to write than one override).
        path = os.path.expanduser(raw)
        if not os.path.isfile(path):
            raise GenrunError(f"{TASKS_KEY}={raw!r} is not a file; give a YAML file listing tasks, or the list itself")
        try:
            raw = OmegaConf.load(path)
        except Exception as exc:  # noqa: BLE001 - YAML and OmegaConf errors alike
            raise GenrunError(
                f"{TASKS_KEY}={raw!r} is not a YAML list of tasks: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
            ) from None
    entries = OmegaConf.to_container(raw, resolve=True) if not isinstance(raw, list | dict) else raw
    if not entries:
        raise GenrunError(
            f"{named} lists no tasks; list at least one task, or unset {TASKS_KEY} to read data.train_files"
        )
    if isinstance(entries, dict):
        entries = [entries]
    if not isinstance(entries, list):
        raise GenrunError(f"{TASKS_KEY} must be a list of tasks, got {type(entries).__name__}")
    return [TaskConfig.of(entry, f"{TASKS_KEY}[{i}]") for i, entry in enumerate(entries)]


def _build_table(task: Task, first_index: int, storage_options: dict[str, Any] | None) -> pa.Table:
    log_hub_build(task.config.where, task.config.loading_params)
    dataset = task.load(storage_options)
    task.check_columns(list(dataset.column_names))
    logger.info("building task %s: %d rows", task.config.data_source, len(dataset))
    rows = []
    for position, row in enumerate(dataset):
        try:
            rows.append(task.build_row(cast(dict[str, Any], row), first_index + position))
        except Exception as exc:  # noqa: BLE001 - a custom build_row may raise anything: one line names the row
            raise _row_error(task, position, exc) from None
    if not rows:
        raise GenrunError(f"{task.config.where}: the dataset split has no rows")
    return pa.Table.from_pylist(rows)


def _row_error(task: Task, position: int, exc: Exception) -> GenrunError:
    """The one line for a row that does not build: the task, the row (its 0-based position in the
    split) and why; the traceback of an error in the user's code goes to the debug log."""
    where = f"{task.config.where} row {position}"
    text = str(exc).splitlines()[0] if str(exc) else ""
    if isinstance(exc, BadRow | GenrunError):
        return GenrunError(f"{where}: {text}")
    logger.debug("%s: %s.build_row raised", where, type(task).__name__, exc_info=exc)
    raised = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return GenrunError(f"{where}: {type(task).__name__}.build_row raised {raised}; fix the task class or the row")


def _one_schema(where: list[str], files: list[bytes]) -> pa.Schema | None:
    """The schema every built file must share (the run's files have one schema: extra fields
    that differ between tasks become null where a task has none), or None when they share one."""
    schemas = [pq.ParquetFile(io.BytesIO(data)).schema_arrow for data in files]
    if all(schema.equals(schemas[0]) for schema in schemas):
        return None
    try:
        return pa.unify_schemas(schemas, promote_options="permissive")
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        raise GenrunError(
            f"{', '.join(where)} build rows of types that do not combine ({str(exc).splitlines()[0]}); give the same columns one type in every task"
        ) from None


def _in_schema(data: bytes, schema: pa.Schema) -> pa.Table:
    return pa.Table.from_pylist(pq.read_table(io.BytesIO(data)).to_pylist(), schema=schema)


def build_tasks(cfg: DictConfig) -> list[BuiltTask]:
    """Every task of `data.train_tasks`, built into the cache (or found there), in one schema."""
    configs = task_configs(cfg)
    prompt_key = cfg.data.prompt_key
    storage_options = (
        OmegaConf.to_container(cfg.data.storage_options, resolve=True) if cfg.data.get("storage_options") else None
    )
    cache = StorageFolder(
        os.path.expanduser(cfg.data.get("task_cache_dir") or DEFAULT_CACHE_DIR), data_storage_options(cfg)
    )
    classes = [(config, load_task_class(config)) for config in configs]  # every class loads before anything is built
    names, files, code_hashes = [], [], []
    first_index = 0
    for config, task_class in classes:
        code_hashes.append(task_code_digest(task_class, config.custom_cls["path"] if config.custom_cls else None))
        config_hash = config.config_hash(prompt_key, cast(dict, storage_options))
        key = hashlib.sha256(f"{code_hashes[-1]}\0{config_hash}\0{first_index}".encode()).hexdigest()
        names.append(f"{''.join(c if c.isalnum() else '_' for c in config.data_source)[:40]}-{key[:20]}")
        task = task_class(config, prompt_key)
        build = functools.partial(_build_table, task, first_index, cast(dict, storage_options))
        data, num_rows = cached_parquet(cache, f"{names[-1]}.parquet", build)
        files.append((data, num_rows))
        first_index += num_rows
    schema = _one_schema([config.where for config in configs], [data for data, _ in files])
    built = []
    for name, (data, num_rows), code_hash in zip(names, files, code_hashes, strict=True):
        if schema is not None:
            # The task's rows in the schema the tasks share, cached beside its own file.
            name = f"{name}-{hashlib.sha256(schema.serialize().to_pybytes()).hexdigest()[:12]}"
            data, num_rows = cached_parquet(cache, f"{name}.parquet", functools.partial(_in_schema, data, schema))
        built.append(BuiltTask(cache.display(f"{name}.parquet"), hashlib.sha256(data).hexdigest(), code_hash, num_rows))
    return built


def resolve_train_tasks(cfg: DictConfig, default_train_files: str) -> list[BuiltTask]:
    """Build `data.train_tasks` and point `data.train_files` at the built files (nothing when
    `data.train_tasks` is unset). Both set by the user is refused: which one would the run read?"""
    if not task_configs(cfg):
        return []
    if cfg.data.train_files not in (None, default_train_files, []):
        raise GenrunError(
            f"{TASKS_KEY} and data.train_files={cfg.data.train_files!r} are both set; tasks build the train files: set only one"
        )
    built = build_tasks(cfg)
    cfg.data.train_files = [task.url for task in built]
    return built
