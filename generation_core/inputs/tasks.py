"""Tasks instead of preprocessing scripts: `data.train_tasks` built into Parquet prompt files.

A task names a dataset as `datasets.load_dataset` takes it (`loading_params`: a hub id, or
`parquet`/`json`/`csv` with `data_files`, local or fsspec, or a folder written by
`save_to_disk`), how a row becomes a prompt (`prompt_format`: a `template` naming columns, with
an optional `system_prompt`, or `chat_messages` read from a column), its `data_source`, the
`extra_fields` carried into `extra_info`, and optionally `custom_cls` (`path` + `name`): a
subclass of `Task` that adds to each row (e.g. `reward_model.ground_truth`).

Preflight (plan/preflight.py) resolves the tasks into `data.train_files` before anything else
reads the dataset: each task's rows, in verl's RL layout (`data_source`, the prompt column,
`ability`, `reward_model`, `extra_info` with a unique `index`), are written once as Parquet under
`data.task_cache_dir`, named by the hash of the task's config, code and input files
(inputs/task_cache.py), and reused while all stay the same. Several tasks make several files,
indexed one after another. A bad task (an unknown column in the template, a positional template
field, a missing split, a class that does not load) is refused in one line before anything is
built; a row the task cannot build (a null template field, content that is not text, an error in a
custom `build_row`) is refused in one line naming the task and the row.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import inspect
import io
import json
import logging
import os
import string
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import pyarrow as pa
import pyarrow.parquet as pq
from omegaconf import DictConfig, OmegaConf

from generation_core.errors import GenrunError
from generation_core.inputs.chat_content import NotText, content_text
from generation_core.inputs.dataset_files import data_storage_options
from generation_core.inputs.task_cache import (
    cached_parquet,
    input_files,
    is_hub_dataset,
    log_hub_build,
    task_code_digest,
)
from generation_core.store.folder import StorageFolder

logger = logging.getLogger(__name__)

TASKS_KEY = "data.train_tasks"
DEFAULT_CACHE_DIR = "~/.cache/genrun/tasks"
PROMPT_FORMATS = ("template", "chat_messages")
_TASK_KEYS = {"loading_params", "prompt_format", "data_source", "extra_fields", "custom_cls", "ability"}


@dataclass(frozen=True)
class TaskConfig:
    """One entry of `data.train_tasks`, checked. `where` names it in messages (`data.train_tasks[0]`)."""

    where: str
    loading_params: dict[str, Any]
    prompt_format: dict[str, Any]
    data_source: str
    extra_fields: list[str] = field(default_factory=list)
    custom_cls: dict[str, str] | None = None
    ability: str | None = None

    @classmethod
    def of(cls, entry: Any, where: str) -> TaskConfig:
        if not isinstance(entry, dict):
            raise GenrunError(
                f"{where} must be a mapping with loading_params and prompt_format, got {type(entry).__name__}"
            )
        unknown = sorted(set(entry) - _TASK_KEYS)
        if unknown:
            raise GenrunError(f"{where}.{unknown[0]}: unknown task key; known: {', '.join(sorted(_TASK_KEYS))}")
        loading = entry.get("loading_params")
        if not isinstance(loading, dict) or not loading.get("path"):
            raise GenrunError(
                f"{where}.loading_params.path is missing: name a hub dataset, parquet/json/csv (with data_files) or a save_to_disk folder"
            )
        prompt_format = entry.get("prompt_format") or {}
        kind = prompt_format.get("type", "template") if isinstance(prompt_format, dict) else None
        if kind not in PROMPT_FORMATS:
            raise GenrunError(f"{where}.prompt_format.type={kind!r}; use one of {', '.join(PROMPT_FORMATS)}")
        needed = "prompt_template" if kind == "template" else "chat_messages_field"
        if not isinstance(prompt_format.get(needed), str):
            raise GenrunError(f"{where}.prompt_format.{needed} is missing: prompt_format type {kind} needs it")
        if kind == "template":
            try:
                template_fields(prompt_format["prompt_template"])
            except ValueError as exc:
                raise GenrunError(f"{where}.prompt_format.prompt_template: {exc}") from None
        custom = entry.get("custom_cls")
        if custom is not None and not (isinstance(custom, dict) and custom.get("path") and custom.get("name")):
            raise GenrunError(
                f"{where}.custom_cls needs path (a .py file) and name (a Task subclass in it), got {custom!r}"
            )
        extra = entry.get("extra_fields") or []
        if not isinstance(extra, list) or not all(isinstance(name, str) for name in extra):
            raise GenrunError(f"{where}.extra_fields must be a list of column names, got {extra!r}")
        data_source = entry.get("data_source") or str(loading["path"])
        return cls(
            where,
            dict(loading),
            {"type": kind, **prompt_format},
            str(data_source),
            list(extra),
            custom,
            entry.get("ability"),
        )

    def config_hash(self, prompt_key: str, storage_options: dict[str, Any] | None = None) -> str:
        """The task's config (its place in the list aside), the prompt column it writes and the
        version of every input file it reads (task_cache.input_files)."""
        payload = {k: v for k, v in self.__dict__.items() if k != "where"}
        payload["prompt_key"] = prompt_key
        payload["inputs"] = input_files(self.where, self.loading_params, storage_options)
        return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()


class BadRow(ValueError):
    """A row the task cannot build; the message says why, `build_tasks` adds the task and row."""


class Task:
    """A dataset turned into prompt rows. Subclass it (`custom_cls`) and override `build_row`
    to add fields, e.g. `reward_model.ground_truth`; call `super().build_row` first."""

    def __init__(self, config: TaskConfig, prompt_key: str = "prompt"):
        self.config = config
        self.prompt_key = prompt_key

    def load(self, storage_options: dict[str, Any] | None = None):
        """The dataset split the task reads (a `datasets.Dataset`)."""
        import datasets

        datasets.disable_progress_bars()  # preflight prints its own few lines
        params = dict(self.config.loading_params)
        split = params.pop("split", "train")
        path = str(params.pop("path"))
        local = os.path.expanduser(path)
        try:
            if os.path.isdir(local) and any(
                (Path(local) / marker).exists() for marker in ("dataset_dict.json", "state.json")
            ):
                loaded = datasets.load_from_disk(local, storage_options=storage_options)
            else:
                if storage_options and "storage_options" not in params:
                    params["storage_options"] = storage_options
                if not is_hub_dataset(path):
                    # Tasks load only when the cache key says an input changed; datasets' own cache
                    # knows a remote file by its ETag or mtime alone and, without either, returns old rows.
                    params.setdefault("download_mode", "force_redownload")
                loaded = datasets.load_dataset(path, **params)
        except (FileNotFoundError, ValueError, datasets.exceptions.DatasetNotFoundError) as exc:
            raise GenrunError(
                f"{self.config.where}.loading_params: cannot load {path!r}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
            ) from None
        if isinstance(loaded, datasets.DatasetDict):
            if split not in loaded:
                raise GenrunError(
                    f"{self.config.where}.loading_params.split={split!r} is not in {path!r}; its splits: {', '.join(loaded)}"
                )
            return loaded[split]
        return loaded

    def check_columns(self, columns: list[str]) -> None:
        """Refuse a template, messages field or extra field that names no column."""
        fmt = self.config.prompt_format
        if fmt["type"] == "template":
            fields = template_fields(fmt["prompt_template"])
            names = [(name.split(".")[0].split("[")[0], "prompt_format.prompt_template") for name in fields]
        else:
            names = [(fmt["chat_messages_field"], "prompt_format.chat_messages_field")]
        names += [(name, "extra_fields") for name in self.config.extra_fields]
        for name, key in names:
            if name not in columns:
                raise GenrunError(
                    f"{self.config.where}.{key}: unknown column {name!r}; the dataset's columns: {', '.join(columns)}"
                )

    def build_prompt(self, row: dict[str, Any]) -> list[dict[str, str]]:
        """The row's chat messages; BadRow when the row has none a chat template reads as text."""
        fmt = self.config.prompt_format
        if fmt["type"] == "chat_messages":
            column = fmt["chat_messages_field"]
            if not row[column]:
                raise BadRow(f"column {column!r} holds no messages; leave the row out of the dataset")
            return [_text_message(column, position, message) for position, message in enumerate(row[column])]
        messages = [{"role": "system", "content": fmt["system_prompt"]}] if fmt.get("system_prompt") else []
        return [*messages, {"role": "user", "content": _formatted(fmt["prompt_template"], row)}]

    def build_row(self, row: dict[str, Any], index: int) -> dict[str, Any]:
        """One prompt row in verl's RL layout; `index` is its unique `extra_info.index`."""
        extra = {name: row[name] for name in self.config.extra_fields}
        return {
            "data_source": self.config.data_source,
            self.prompt_key: self.build_prompt(row),
            "ability": self.config.ability or "",
            "reward_model": {"style": "rule", "ground_truth": ""},
            "extra_info": {**extra, "index": index},
        }


@functools.cache
def template_fields(template: str) -> tuple[str, ...]:
    """The replacement fields of a prompt template (`{question}`, `{meta[topic]}`), those inside
    format specs too; ValueError for a template Python cannot format or a positional field
    (`{}`, `{0}`), which no column fills."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise ValueError(
            f"{template!r} is not a format string ({exc}); name columns as {{column}}, write a literal brace twice"
        ) from None
    fields: list[str] = []
    for _, name, spec, _ in parsed:
        if name is None:
            continue
        root = name.split(".")[0].split("[")[0]
        if not root or root.isdigit():
            raise ValueError(
                f"the positional field {{{name}}} names no column; name a column instead, e.g. {{question}}"
            )
        fields.append(name)
        if spec and "{" in spec:
            fields += template_fields(spec)
    return tuple(dict.fromkeys(fields))


def _formatted(template: str, row: dict[str, Any]) -> str:
    """The template filled from the row; a null field is refused, as the text 'None' is no prompt."""
    formatter = string.Formatter()
    try:
        for name in template_fields(template):
            if formatter.get_field(name, (), row)[0] is None:
                raise BadRow(f"{{{name}}} of prompt_template is null; fill it or leave the row out of the dataset")
        return template.format(**row)
    except (KeyError, IndexError, AttributeError, TypeError, ValueError) as exc:
        if isinstance(exc, BadRow):
            raise
        reason = f"{type(exc).__name__}: {exc}".splitlines()[0]
        raise BadRow(f"prompt_template cannot be filled from the row: {reason}") from None


def _text_message(column: str, position: int, message: Any) -> dict[str, str]:
    """One chat message with text content (content parts joined); BadRow for anything else."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise BadRow(f"{column}[{position}] is not a message with a role")
    if message.get("tool_calls"):
        raise BadRow(
            f"{column}[{position}] has tool_calls, which a prompt of text messages would drop; give text messages"
        )
    try:
        return {"role": message["role"], "content": content_text(message.get("content"))}
    except NotText as exc:
        raise BadRow(f"{column}[{position}].{exc}; fix the row or leave it out of the dataset") from None


def load_task_class(config: TaskConfig) -> type[Task]:
    """`custom_cls`'s class, loaded from its file as the reward file is (its folder first on the path)."""
    if config.custom_cls is None:
        return Task
    path = os.path.expanduser(config.custom_cls["path"])
    name = config.custom_cls["name"]
    where = f"{config.where}.custom_cls"
    if not os.path.isfile(path):
        raise GenrunError(f"{where}.path={path!r} does not exist; name a .py file that defines {name}")
    module_name = f"genrun_task_{hashlib.sha256(os.path.abspath(path).encode()).hexdigest()[:12]}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise GenrunError(f"{where}.path={path!r} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - any error importing the user's file
        raise GenrunError(
            f"{where}.path={path!r} fails to import: {type(exc).__name__}: {exc}".splitlines()[0]
        ) from None
    finally:
        sys.path.pop(0)
    sys.modules[module_name] = module
    found = getattr(module, name, None)
    if not (inspect.isclass(found) and issubclass(found, Task)):
        raise GenrunError(
            f"{where}.name={name!r}: {path} defines no subclass of generation_core.inputs.tasks.Task by that name"
        )
    return found


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
    raw = OmegaConf.select(cfg, TASKS_KEY)
    if raw is None:
        return []
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
    if isinstance(entries, dict):
        entries = [entries]
    if not isinstance(entries, list):
        raise GenrunError(f"{TASKS_KEY} must be a list of tasks, got {type(entries).__name__}")
    return [TaskConfig.of(entry, f"{TASKS_KEY}[{i}]") for i, entry in enumerate(entries)]


def _build_table(task: Task, first_index: int, storage_options: dict[str, Any] | None) -> pa.Table:
    log_hub_build(task.config.where, task.config.loading_params)
    dataset = task.load(storage_options)
    task.check_columns(list(dataset.column_names))
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
    there are no tasks). Both set by the user is refused: which one would the run read?"""
    if not task_configs(cfg):
        return []
    if cfg.data.train_files not in (None, default_train_files, []):
        raise GenrunError(
            f"{TASKS_KEY} and data.train_files={cfg.data.train_files!r} are both set; tasks build the train files: set only one"
        )
    built = build_tasks(cfg)
    cfg.data.train_files = [task.url for task in built]
    return built
