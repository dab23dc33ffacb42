"""Tasks instead of preprocessing scripts: what one entry of `data.train_tasks` is, and how its
dataset's rows become prompt rows (task_build.py builds them into Parquet prompt files).

A task names a dataset as `datasets.load_dataset` takes it (`loading_params`: a hub id, or
`parquet`/`json`/`csv` with `data_files`, local or fsspec, or a folder written by
`save_to_disk`), how a row becomes a prompt (`prompt_format`: a `template` naming columns, with
an optional `system_prompt`, or `chat_messages` read from a column), its `data_source`, the
`extra_fields` carried into `extra_info`, and optionally `custom_cls` (`path` + `name`): a
subclass of `Task` that adds to each row (e.g. `reward_model.ground_truth`).

A bad task (an unknown column in the template, a positional template field or one with attribute
or index access, a missing split, a class that does not load) is refused in one line before
anything is built; a row the task cannot build (a null template field, a message outside the
rule of chat_content.prompt_message: a role no chat template renders, content that is not text,
tool calls; an error in a custom `build_row`) is refused in one line naming the task and the row.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import inspect
import json
import os
import string
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from generation_core.errors import GenrunError
from generation_core.inputs.chat_content import BadMessage, NotText, prompt_message
from generation_core.inputs.task_cache import input_files, is_hub_dataset

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
        data_source = entry.get("data_source") or default_data_source(loading)
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


def default_data_source(loading: dict[str, Any]) -> str:
    """A task's data_source when it names none: the hub dataset or folder its `path` names; for a
    builder `datasets` ships (`json`, `parquet`, `csv`, ...), which names no dataset, the stem of
    its first data file (`gsm8k.jsonl` -> `gsm8k`), or that file's folder for a glob."""
    path = str(loading["path"])
    files = loading.get("data_files")
    first = next(iter(files.values()), None) if isinstance(files, dict) else files
    while isinstance(first, list | tuple):
        first = first[0] if first else None
    if first is None or is_hub_dataset(path) or "://" in path or os.path.exists(os.path.expanduser(path)):
        return path
    folder, name = os.path.split(str(first).rstrip("/"))
    if any(char in name for char in "*?["):
        name = os.path.basename(folder)
    return name.split(".", 1)[0] or path


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
            names = [(name, "prompt_format.prompt_template") for name in fields]
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
    """The replacement fields of a prompt template (`{question}`), those inside format specs
    too; ValueError for a template Python cannot format, a positional field (`{}`, `{0}`), which
    no column fills, or a field with attribute or index access (`{question.upper}`,
    `{meta[topic]}`), which is no column's value."""
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
        if root != name:
            # str.format would fill {question.upper} with a method's repr and {question[0]} with one
            # character: a field is a column's value, whole.
            raise ValueError(
                f"the field {{{name}}} reads an attribute or an item of column {root!r}, which a prompt does not "
                f"take; name the column alone, e.g. {{{root}}}, or build the text in a custom_cls build_row"
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
    """One chat message by the rule of the prompts genrun builds (chat_content.prompt_message,
    the OpenAI batch reader's too); BadRow naming the message for anything else."""
    try:
        return prompt_message(message)
    except BadMessage as bad:
        advice = "; fix the row or leave it out of the dataset" if isinstance(bad, NotText) else ""
        raise BadRow(f"{column}[{position}]{bad}{advice}") from None


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
