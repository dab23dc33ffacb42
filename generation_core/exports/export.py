"""`genrun export`: a run's committed trajectories as one SFT Parquet file (local or s3://); the
command's other layouts and formats are dispatched from here (export_command).

One row per trajectory, read part by part from the committed parts (key_order.py says how
many at once), with the chat messages rebuilt from its tokens by sft_messages.py:
- layout `messages` (default): `messages` (the prompt's messages, then the assistant and the
  tool/user turns), what verl's `MultiTurnSFTDataset` reads (`data.messages_key`);
- layout `prompt-completion` (earlier name `prompt-response`, still accepted): `prompt` (the
  prompt's messages) and `completion` (the turns after it), TRL's conversational
  prompt-completion layout (both layouts load into TRL's SFTTrainer);
and in both: `images` where the run's prompts had images (TRL's vision-language layout:
sft_images.py), `index`, `rollout_n`, `data_source`, `reward` (null where the trajectory has no
score), `num_turns`, `truncated` (the last turn was cut at the length limit: it has no
end-of-sequence token, which rendering the messages adds) and, when the run had tools, `tools`
(their schemas, as the agent loop rendered them into the prompt; verl's `data.tools_key`).

Filters: `--min-reward X` keeps trajectories scored at least X; `--best-of-n` keeps the
highest-scored trajectory of each prompt (ties: the lowest rollout_n; a prompt with no scored
trajectory has no best and is left out, counted apart), which needs a first pass
over the parts' index/rollout_n/reward columns. Rows come out sorted by (index, rollout_n) across
the whole run, as verl's merged DataProto is. The output file appears whole or not at all
(StorageFolder.open_write), also when the export fails half way; where it may go and when it
may replace a file: export_target.py.
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, NoReturn, TypeGuard

import pyarrow as pa
import pyarrow.parquet as pq

from generation_core.engines.base import eos_token_ids
from generation_core.errors import GenrunError
from generation_core.exports import export_tools, openai_batch_output, rl_prompts, sft_images
from generation_core.exports.dataset_card import RowStats, RunProgress, unfinished_run, write_dataset_card
from generation_core.exports.export_options import (
    OPENAI_BATCH,
    OPENAI_BATCH_INPUT,
    RL_PROMPTS,
    ExportOptions,
    check_combination,
)
from generation_core.exports.export_target import output_location
from generation_core.exports.key_order import PartKeys, committed_parts_to_export, part_keys, records_in_key_order
from generation_core.exports.openai_batch_input import BatchInputSummary, export_openai_batch_input
from generation_core.exports.openai_batch_output import BatchExportSummary, errors_name, export_openai_batch
from generation_core.exports.sft_messages import MessageRebuilder, RebuiltTrajectory, prompt_of
from generation_core.inputs.tokenizer import run_tokenizer, tokenizer_dir
from generation_core.store.folder import StorageFolder
from generation_core.store.part_repair import CommittedPartRef, DamagedPart, read_verified_part, repair_advice
from generation_core.store.run_folder import read_run_record
from generation_core.store.trajectory_record import TIMINGS, TrajectoryRecord, read_part_table, score_or_none, to_json

logger = logging.getLogger(__name__)

MESSAGE = pa.struct([pa.field("role", pa.string()), pa.field("content", pa.string())])
MESSAGES = pa.list_(MESSAGE)
ROWS_PER_GROUP = 1000
"""Rows per Parquet row group: rows come out one at a time in key order, written in groups."""


@dataclass
class ExportSummary:
    """What an SFT export wrote and what its filters left out: its line on the terminal and the
    counts and filters its dataset card states."""

    output: str
    options: ExportOptions
    rows: int = 0
    committed: int = 0
    scored: int = 0
    below_min_reward: int = 0
    not_best: int = 0
    unscored_prompts: int = 0
    """Trajectories of prompts none of whose trajectories is scored: --best-of-n has no best there."""
    truncated: int = 0
    unmatched_turns: int = 0
    dropped_prompt_keys: dict[str, int] = field(default_factory=dict)
    """Per key of prompt messages the layout has no field for (`name`, `tool_calls`, ...): the
    exported rows whose prompt set it (the summary line names them)."""
    stats: RowStats = field(default_factory=RowStats)
    """Lengths and rewards of the exported rows, for the dataset card."""
    card: str | None = None
    unfinished: RunProgress | None = None
    """How far the run got, when it is not finished (dataset_card.unfinished_run)."""

    def kept(self, record: TrajectoryRecord, keep: dict[int, int] | None) -> bool:
        """Whether the filters keep `record`, counting it (committed, scored) and what dropped it."""
        self.committed += 1
        self.scored += record.reward_score is not None
        if self.options.min_reward is not None and not _scored_at_least(record.reward_score, self.options.min_reward):
            self.below_min_reward += 1
            return False
        if keep is not None and record.index not in keep:
            self.unscored_prompts += 1
            return False
        if keep is not None and keep[record.index] != record.rollout_n:
            self.not_best += 1
            return False
        return True

    def add(self, record: TrajectoryRecord, rebuilt: RebuiltTrajectory) -> None:
        self.rows += 1
        self.truncated += rebuilt.truncated
        self.unmatched_turns += rebuilt.unmatched_turns
        for key in rebuilt.dropped_prompt_keys:
            self.dropped_prompt_keys[key] = self.dropped_prompt_keys.get(key, 0) + 1
        self.stats.add(
            len(record.response_ids), record.reward_score, record.num_turns, record.input_fields.get("agent_name")
        )

    def line(self) -> str:
        dropped = []
        if self.options.min_reward is not None:
            dropped.append(f"{self.below_min_reward} below --min-reward {self.options.min_reward:g} or unscored")
        if self.options.best_of_n:
            dropped.append(f"{self.not_best} not the best of their prompt")
            if self.unscored_prompts:
                dropped.append(f"{self.unscored_prompts} of prompts with no scored trajectory, which have no best")
        text = f"exported {self.rows} of {self.committed} committed trajectories to {self.output}"
        text += f" ({'; '.join(dropped)})" if dropped else ""
        text += f"; {self.truncated} cut at the length limit (truncated=true)"
        text += f"; dataset card {self.card}" if self.card else ""
        text += f"; partial: {self.unfinished}" if self.unfinished else ""
        if self.unmatched_turns:
            text += (
                f"; {self.unmatched_turns} tool/user turn(s) the chat template does not explain, "
                "kept as raw text in user messages"
            )
        if self.dropped_prompt_keys:
            keys = ", ".join(f"{key} ({rows} rows)" for key, rows in sorted(self.dropped_prompt_keys.items()))
            text += f"; prompt message keys the layout has no field for, not exported: {keys}"
        return text

    def card_counts(self) -> dict[str, int]:
        return {
            "committed trajectories": self.committed,
            "exported rows": self.rows,
            "scored trajectories (of the committed)": self.scored,
            "exported rows cut at the length limit (truncated)": self.truncated,
            **(self.unfinished.card_counts() if self.unfinished else {}),
        }

    def card_filters(self) -> list[str]:
        """The filters the export applied, with what each dropped."""
        filters = []
        if self.options.min_reward is not None:
            filters.append(
                f"`--min-reward {self.options.min_reward:g}`: kept trajectories scored at least "
                f"{self.options.min_reward:g} ({self.below_min_reward} dropped, unscored ones included)"
            )
        if self.options.best_of_n:
            filters.append(
                "`--best-of-n`: kept the highest-scored trajectory of each prompt "
                f"({self.not_best} dropped; {self.unscored_prompts} of prompts with no scored trajectory)"
            )
        return filters


def export_command(
    run_url: str, out_url: str, options: ExportOptions, storage_options: dict[str, Any] | None = None
) -> int:
    """`genrun export`: the layout or format `options` ask for, and its summary line."""
    check_combination(options)
    if options.layout == RL_PROMPTS:
        export: Callable[..., Any] = rl_prompts.export_prompts
    else:
        export = {OPENAI_BATCH: export_batch_output, OPENAI_BATCH_INPUT: export_batch_input}.get(
            options.format, export_run
        )
    try:
        summary = export(run_url, out_url, options, storage_options)
    except DamagedPart as damaged:
        raise GenrunError(f"{damaged}; {repair_advice(StorageFolder(run_url, storage_options))}") from None
    print(summary.line())
    return 0


def export_batch_output(
    run_url: str, out_url: str, options: ExportOptions, storage_options: dict[str, Any] | None = None
) -> BatchExportSummary:
    """The run in the OpenAI batch output layout (exports/openai_batch_output.py)."""
    folder = StorageFolder(run_url, storage_options)
    record = read_run_record(folder)
    openai_batch_output.check_batch_run(folder, record)
    config = record.config
    errors = errors_name(str(out_url).rstrip("/").rpartition("/")[2])
    out_folder, out_name = output_location(out_url, folder, storage_options, options, beside=(errors,))
    data_options = config.get("data", {}).get("storage_options") or storage_options
    tokenizer = _tokenizer(config, options)
    return export_openai_batch(
        folder, out_folder, out_name, tokenizer, _eos_ids(config, options.tokenizer, tokenizer), data_options
    )


def export_batch_input(
    run_url: str, out_url: str, options: ExportOptions, storage_options: dict[str, Any] | None = None
) -> BatchInputSummary:
    """The run's prompts in the OpenAI batch input layout (exports/openai_batch_input.py)."""
    folder = StorageFolder(run_url, storage_options)
    out_folder, out_name = output_location(out_url, folder, storage_options, options)
    return export_openai_batch_input(folder, out_folder, out_name, options.trust_remote_code)


def export_run(
    run_url: str, out_url: str, options: ExportOptions, storage_options: dict[str, Any] | None = None
) -> ExportSummary:
    """The run as SFT Parquet (see the module docstring), with its dataset card beside it."""
    folder = StorageFolder(run_url, storage_options)
    record = read_run_record(folder)
    parts = committed_parts_to_export(folder)
    out_folder, out_name = output_location(out_url, folder, storage_options, options)
    tools = export_tools.run_tool_schemas(record.config, options.trust_remote_code)
    rebuilder = MessageRebuilder(
        _tokenizer(record.config, options),
        tools,
        record.config.get("data", {}).get("apply_chat_template_kwargs"),
        _eos_ids(record.config, options.tokenizer),
    )
    keep = best_samples(folder, parts, options.min_reward) if options.best_of_n else None
    summary = ExportSummary(out_folder.display(out_name), options, unfinished=unfinished_run(folder, record))
    keyed = part_keys(folder, parts)
    # TRL's vision-language layout where a row has images (exports/sft_images.py).
    rebuilder.keep_parts = sft_images.run_has_images(keyed)
    schema = export_schema(options.layout, tools)
    with out_folder.open_write(out_name) as sink:
        rows = _sft_rows(folder, keyed, summary, keep, rebuilder, tools)
        write_parquet(sink, sft_images.with_image_fields(schema) if rebuilder.keep_parts else schema, rows)
        if not summary.rows:
            # Raised inside the block: nothing is published.
            _refuse_empty(folder, summary)
    card = write_dataset_card(
        out_folder, out_name, record, summary.card_counts(), summary.card_filters(), options.layout, summary.stats
    )
    summary.card = out_folder.display(card)
    return summary


def _sft_rows(
    folder: StorageFolder,
    keyed: list[PartKeys],
    summary: ExportSummary,
    keep: dict[int, int] | None,
    rebuilder: MessageRebuilder,
    tools: list[dict[str, Any]] | None,
) -> Iterator[dict[str, Any]]:
    """The trajectories the filters keep, as export rows in key order, counted in `summary`."""
    for trajectory, part in records_in_key_order(folder, [k.part for k in keyed], keyed):
        if summary.kept(trajectory, keep):
            rebuilt = rebuilder.rebuild(prompt_of(trajectory), trajectory.response_ids, trajectory.response_mask)
            summary.add(trajectory, rebuilt)
            row = _row(trajectory, rebuilt, summary.options.layout, tools, part.storage_seconds_per_row)
            yield sft_images.image_row(row, trajectory.images) if rebuilder.keep_parts else row


def write_parquet(sink: Any, schema: pa.Schema, rows: Iterable[dict[str, Any]]) -> None:
    """`rows` as a zstd Parquet file into `sink`, ROWS_PER_GROUP rows at a time (never all held)."""
    rows = iter(rows)
    with pq.ParquetWriter(sink, schema, compression="zstd") as writer:
        while group := list(itertools.islice(rows, ROWS_PER_GROUP)):
            writer.write_table(pa.Table.from_pylist(group, schema=schema))


def _refuse_empty(folder: StorageFolder, summary: ExportSummary) -> NoReturn:
    if not summary.scored:
        raise GenrunError(
            f"no trajectory of {folder.display()} has a reward, which --min-reward needs (a reward function, "
            "reward.custom_reward_function.path, or an agent loop that scores); nothing written"
        )
    raise GenrunError(
        f"no trajectory of {folder.display()} passes the filters ({summary.committed} committed, "
        f"{summary.scored} scored); nothing written"
    )


def _row(
    record: TrajectoryRecord, rebuilt: RebuiltTrajectory, layout: str, tools, storage_seconds: float | None
) -> dict[str, Any]:
    row: dict[str, Any] = (
        {"messages": rebuilt.messages}
        if layout == "messages"
        else {"prompt": rebuilt.prompt, "completion": rebuilt.response}
    )
    row.update(
        index=record.index,
        rollout_n=record.rollout_n,
        data_source=record.input_fields.get("data_source"),
        reward=record.reward_score,
        num_turns=record.num_turns,
        truncated=rebuilt.truncated,
        # Where and how it was made, and where its time went (trajectory_record.PROVENANCE_KEYS, TIMINGS);
        # null for trajectories of genruns that did not keep them.
        provenance=None if record.provenance is None else to_json(record.provenance),
        timings=None if record.timings is None else dict(record.timings, storage=storage_seconds),
    )
    if tools is not None:
        row["tools"] = export_tools.selected_tools(tools, record.input_fields)
    return row


def export_schema(layout: str, tools: list[dict[str, Any]] | None) -> pa.Schema:
    text = (
        [pa.field("messages", MESSAGES)]
        if layout == "messages"
        else [pa.field("prompt", MESSAGES), pa.field("completion", MESSAGES)]
    )
    fields = [
        *text,
        pa.field("index", pa.int64()),
        pa.field("rollout_n", pa.int32()),
        pa.field("data_source", pa.string()),
        pa.field("reward", pa.float64()),
        pa.field("num_turns", pa.int32()),
        pa.field("truncated", pa.bool_()),
        pa.field("provenance", pa.string()),
        pa.field("timings", pa.struct([pa.field(name, pa.float64()) for name in (*TIMINGS, "storage")])),
    ]
    if tools is not None:
        # One type for every row group, inferred from every schema (a row may carry a subset).
        fields.append(pa.field("tools", pa.array([tools]).type))
    return pa.schema(fields)


def best_samples(folder: StorageFolder, parts: list[CommittedPartRef], min_reward: float | None) -> dict[int, int]:
    """The rollout_n of the highest-scored trajectory of each prompt, by index (ties: the lowest
    rollout_n), among those scored at least `min_reward`; reads three columns of every part."""
    best: dict[int, tuple[float, int]] = {}
    scored = 0
    for part in parts:
        table = read_part_table(read_verified_part(folder, part), ["index", "rollout_n", "reward_score"])
        for index, rollout_n, reward in zip(
            *(table.column(name).to_pylist() for name in table.column_names), strict=True
        ):
            reward = score_or_none(reward)
            scored += reward is not None
            if not _scored_at_least(reward, min_reward):
                continue
            current = best.get(index)
            if current is None or reward > current[0] or (reward == current[0] and rollout_n < current[1]):
                best[index] = (reward, rollout_n)
    if not scored:
        raise GenrunError(
            f"no trajectory of {folder.display()} has a reward, which --best-of-n needs (a reward function, reward.custom_reward_function.path, or an agent loop that scores)"
        )
    return {index: rollout_n for index, (_, rollout_n) in best.items()}


def _scored_at_least(reward: float | None, minimum: float | None) -> TypeGuard[float]:
    """Scored and, with a minimum, at least that (rewards come through score_or_none: NaN is None)."""
    if reward is None:
        return False
    return minimum is None or reward >= minimum


def _tokenizer_dir(config: dict[str, Any], override: str | None) -> str:
    model = config["actor_rollout_ref"]["model"]
    path = os.path.expanduser(override) if override else tokenizer_dir(model)
    if not os.path.isdir(path):
        key = "tokenizer_path" if model.get("tokenizer_path") else "path"
        where = "--tokenizer" if override else f"the run's actor_rollout_ref.model.{key} (run.json)"
        raise GenrunError(
            f"tokenizer folder {path} ({where}) does not exist here; give the run's model or tokenizer folder with --tokenizer DIR"
        )
    return path


def _tokenizer(config: dict[str, Any], options: ExportOptions):
    """The run's tokenizer; code from its folder runs only with the user's --trust-remote-code
    (run.json's trust_remote_code is not followed: reading a folder runs no code it names)."""
    path = _tokenizer_dir(config, options.tokenizer)
    model = dict(config["actor_rollout_ref"]["model"], tokenizer_path=path)
    try:
        return run_tokenizer(model, trust_remote_code=options.trust_remote_code)
    except ValueError as exc:
        # transformers' refusal to run a folder's code without trust_remote_code=True.
        if options.trust_remote_code or "trust_remote_code" not in str(exc):
            raise
        raise GenrunError(
            f"the tokenizer in {path} is code from that folder, which genrun export runs only when asked: add --trust-remote-code "
            "if you trust it, or give a tokenizer folder with --tokenizer DIR"
        ) from None


def _eos_ids(config: dict[str, Any], override: str | None, tokenizer: Any = None) -> set[int]:
    """The ids that end a response (engines.base.eos_token_ids) of the run's model folder, not
    its tokenizer folder, which may have no generation_config.json; with --tokenizer, that
    folder's too (a copy of the model where the run's own folder is not at hand)."""
    ids = set(eos_token_ids(str(config["actor_rollout_ref"]["model"]["path"]), tokenizer))
    return ids | set(eos_token_ids(override)) if override else ids
