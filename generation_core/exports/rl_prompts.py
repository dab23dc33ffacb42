"""`genrun export --layout rl-prompts`: one row per prompt in verl's RL layout, with its pass rate.

Before RL, people sample each prompt n times and keep the prompts the model solves sometimes but
not always: the rest give GRPO no signal. This export reads the committed rewards (three columns
of every part), and writes each prompt's original row from the run's input files (read as the
run read them: `data.train_files` in run.json, tasks already built into files), unchanged but for
`extra_info`, which gains:
- `pass_rate`: the share of the prompt's scored samples whose reward is above the pass threshold
  (`--pass-threshold X`, default 0: "pass" = reward > 0);
- `num_samples`, `num_scored`, `num_passed`: committed samples, those with a reward, those passed;
- `reward_mean`, `reward_std`, `reward_min`, `reward_max` over the scored samples.
`--pass-rate MIN MAX` keeps the prompts whose pass rate lies in [MIN, MAX] (both inclusive; a
prompt with no scored sample has no pass rate and is left out, counted apart). Rows are sorted by
`extra_info.index`, as every export's rows are by their key. The output is what
verl's `RLHFDataset` reads for training (`data.train_files=out.parquet`).

A row's images stay in verl's layout (`<image>` placeholders in its prompt, the `images` column),
each cell as `{"bytes": ...}` of the original image (not the resized one: verl resizes with the
run's processor, as genrun did): a cell that named a path or URL is read into the file, so the
export trains where those paths do not exist.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from omegaconf import OmegaConf

from generation_core.errors import GenrunError
from generation_core.exports.dataset_card import RunProgress, pass_rate_lines, unfinished_run, write_dataset_card
from generation_core.exports.export_options import RL_PROMPTS, ExportOptions
from generation_core.exports.export_target import output_location
from generation_core.exports.key_order import committed_parts_to_export
from generation_core.inputs.dataset_files import read_json_table
from generation_core.inputs.dataset_location import (
    data_storage_options,
    open_input,
    resolve_train_files,
    storage_errors,
)
from generation_core.inputs.images import IMAGE_COLUMN, read_image_source
from generation_core.inputs.shard_rows import planned_rows
from generation_core.run_plan import DatasetFiles
from generation_core.store.folder import StorageFolder
from generation_core.store.part_repair import CommittedPartRef, read_verified_part
from generation_core.store.run_folder import read_run_record
from generation_core.store.trajectory_record import read_part_table, score_or_none

LAYOUT = RL_PROMPTS


@dataclass
class PromptRewards:
    """The committed samples of one prompt: their count and their rewards (None: unscored)."""

    rewards: list[float | None] = field(default_factory=list)

    def statistics(self, threshold: float) -> dict[str, Any]:
        scored = [reward for reward in self.rewards if reward is not None]
        passed = sum(reward > threshold for reward in scored)
        mean = sum(scored) / len(scored) if scored else None
        return {
            "pass_rate": passed / len(scored) if scored else None,
            "num_samples": len(self.rewards),
            "num_scored": len(scored),
            "num_passed": passed,
            "reward_mean": mean,
            "reward_std": math.sqrt(sum((r - mean) ** 2 for r in scored) / len(scored)) if mean is not None else None,
            "reward_min": min(scored) if scored else None,
            "reward_max": max(scored) if scored else None,
        }


@dataclass
class RlPromptsSummary:
    """What an rl-prompts export wrote and left out: its line on the terminal and the counts and
    filters its dataset card states."""

    output: str
    threshold: float
    pass_rate: tuple[float, float] | None
    prompts: int = 0
    rows: int = 0
    unscored: int = 0
    outside_band: int = 0
    card: str | None = None
    unfinished: RunProgress | None = None
    """How far the run got, when it is not finished (dataset_card.unfinished_run)."""

    def line(self) -> str:
        text = f"exported {self.rows} of {self.prompts} prompts to {self.output} (layout {LAYOUT})"
        dropped = []
        if self.pass_rate is not None:
            low, high = self.pass_rate
            dropped.append(f"{self.outside_band} with a pass rate outside [{low:g}, {high:g}]")
        if self.unscored:
            dropped.append(f"{self.unscored} with no scored sample")
        text += f"; left out: {', '.join(dropped)}" if dropped else ""
        text += f"; dataset card {self.card}" if self.card else ""
        return text + (f"; partial: {self.unfinished}" if self.unfinished else "")

    def card_counts(self) -> dict[str, int]:
        return {
            "prompts with committed samples": self.prompts,
            "exported prompts (rows)": self.rows,
            "prompts with no scored sample": self.unscored,
            **(self.unfinished.card_counts() if self.unfinished else {}),
        }

    def card_filters(self) -> list[str]:
        filters = [f"a sample passes with a reward above {self.threshold:g} (`--pass-threshold`)"]
        if self.pass_rate is not None:
            low, high = self.pass_rate
            filters.append(
                f"`--pass-rate {low:g} {high:g}`: kept prompts whose pass rate is in the band "
                f"({self.outside_band} dropped)"
            )
        return filters


def export_prompts(
    run_url: str, out_url: str, options: ExportOptions, storage_options: dict[str, Any] | None = None
) -> RlPromptsSummary:
    """`genrun export --layout rl-prompts` (options checked by export_options.check_combination);
    no tokenizer is needed."""
    folder = StorageFolder(run_url, storage_options)
    config = read_run_record(folder).config
    parts = committed_parts_to_export(folder)
    out = output_location(out_url, folder, storage_options, options)
    threshold = 0.0 if options.pass_threshold is None else options.pass_threshold
    return export_rl_prompts(folder, config, parts, out, threshold, options.pass_rate)


def prompt_rewards(folder: StorageFolder, parts: list[CommittedPartRef]) -> dict[int, PromptRewards]:
    """Every committed sample's reward, by prompt index (three columns of each part)."""
    by_prompt: dict[int, PromptRewards] = {}
    for part in parts:
        table = read_part_table(read_verified_part(folder, part), ["index", "rollout_n", "reward_score"])
        for index, reward in zip(
            table.column("index").to_pylist(), table.column("reward_score").to_pylist(), strict=True
        ):
            by_prompt.setdefault(index, PromptRewards()).rewards.append(score_or_none(reward))
    return by_prompt


def _input_rows(folder: StorageFolder, config: dict[str, Any], wanted: set[int]):
    """The run's input rows whose extra_info.index is in `wanted`, as dicts, in file order: the
    files run.json says the run was planned over (an OpenAI batch file's requests numbered as the
    run numbered them), or for a run.json of an earlier genrun, data.train_files as they are now."""
    cfg = OmegaConf.create(config)
    options = data_storage_options(cfg)
    dataset = read_run_record(folder).dataset
    if dataset:
        rows = planned_rows(DatasetFiles.from_dict(dataset), options)
    else:
        rows = (row for url in resolve_train_files(cfg) for row in _whole_file(url, options))
    for row in rows:
        if (row.get("extra_info") or {}).get("index") in wanted:
            yield row


def _whole_file(url: str, options: dict[str, Any]) -> list[dict[str, Any]]:
    with storage_errors(url):
        if url.endswith((".json", ".jsonl")):
            table = read_json_table(url, options)
        else:
            with open_input(url, options) as handle:
                table = pq.read_table(handle)
    return table.to_pylist()


def image_cell_bytes(cell: Any) -> dict[str, bytes]:
    """An `images` cell of an input row as `{"bytes": ...}` (verl reads such a cell wherever the
    file goes): its own bytes, or those of the path or URL it names (inputs/images.py)."""
    if isinstance(cell, Mapping):
        if cell.get("bytes") is not None:
            return {"bytes": cell["bytes"]}
        cell = cell.get("path") or cell.get("image") or cell.get("image_url")
    return {"bytes": read_image_source(cell)}


def export_rl_prompts(
    folder: StorageFolder,
    config: dict[str, Any],
    parts: list[CommittedPartRef],
    out: tuple[StorageFolder, str],
    threshold: float,
    pass_rate: tuple[float, float] | None,
) -> RlPromptsSummary:
    """Write the rl-prompts layout (see the module's docstring) to `out` (folder, name)."""
    out_folder, out_name = out
    summary = RlPromptsSummary(out_folder.display(out_name), threshold, pass_rate)
    statistics = {}
    for index, rewards in prompt_rewards(folder, parts).items():
        summary.prompts += 1
        stats = rewards.statistics(threshold)
        if stats["pass_rate"] is None:
            summary.unscored += 1
        elif pass_rate is not None and not pass_rate[0] <= stats["pass_rate"] <= pass_rate[1]:
            summary.outside_band += 1
        else:
            statistics[index] = stats
    if summary.unscored == summary.prompts:
        raise GenrunError(
            f"no trajectory of {folder.display()} has a reward, which --layout {LAYOUT} needs (a reward function, reward.custom_reward_function.path); nothing written"
        )
    rows = []
    for row in _input_rows(folder, config, set(statistics)):
        row["extra_info"] = {**row["extra_info"], **statistics[row["extra_info"]["index"]]}
        if row.get(IMAGE_COLUMN) is not None:
            row[IMAGE_COLUMN] = [image_cell_bytes(cell) for cell in row[IMAGE_COLUMN]]
        rows.append(row)
    # The input files' order need not be the index order (several files, a task's rows).
    rows.sort(key=lambda row: row["extra_info"]["index"])
    if len(rows) != len(statistics):
        raise GenrunError(
            f"{len(statistics) - len(rows)} prompt(s) of {folder.display()} are not in the run's input files (data.train_files in run.json) any more; restore them, nothing written"
        )
    if not rows:
        raise GenrunError(
            f"no prompt of {folder.display()} passes --pass-rate ({summary.prompts} prompts, {summary.unscored} unscored); nothing written"
        )
    summary.rows = len(rows)
    with out_folder.open_write(out_name) as sink:
        pq.write_table(pa.Table.from_pylist(rows), sink, compression="zstd")
    pass_rates = [row["extra_info"]["pass_rate"] for row in rows]
    described = pass_rate_lines(pass_rates, [row["extra_info"]["num_samples"] for row in rows])
    record = read_run_record(folder)
    summary.unfinished = unfinished_run(folder, record)
    card = write_dataset_card(
        out_folder,
        out_name,
        record,
        summary.card_counts(),
        summary.card_filters(),
        LAYOUT,
        described,
        Counter(row.get("agent_name") for row in rows),
    )
    summary.card = out_folder.display(card)
    return summary
