"""The dataset card `genrun export` writes beside its Parquet file: a README.md as Hugging Face
datasets have one (YAML front matter naming the data files, then Markdown), saying for each export
in the folder what generated the rows (model, engine, sampling, run fingerprint, genrun build,
input files), how many there are, their reward and length statistics, and the filters applied.

One card per folder lists every export in it: each export is a config of its own named after its
file (`datasets.load_dataset(folder, "sft")` reads sft.parquet), the folder's first export is the
default config (`load_dataset(folder)` keeps reading what it read before a second export came),
and each has its own section, between markers that the next export finds again. Exports differ in
columns (layouts), so one config over all files would not load. An export to a name already listed
(with --overwrite) replaces its entry; an entry whose file is gone is dropped. A card of an earlier
genrun (one file, config `default`) is read as one entry.

Only values a run folder records are written: run.json's config has its secrets masked, and the
card takes named fields of it, never the whole. The card is named README.md unless a README.md
that is not a genrun card is already there (a project's own README is never overwritten): then
`<output name>.README.md`, which describes that one file.
"""

from __future__ import annotations

import json
import re
import statistics
from array import array
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from generation_core.build import describe_build
from generation_core.config.settings import GenerationSettings
from generation_core.outputs.status import shard_states
from generation_core.outputs.summary import agent_loops_text
from generation_core.store.folder import StorageFolder
from generation_core.store.run_record import RunRecord

CARD_MARK = "<!-- written by genrun export -->"
_SECTION = re.compile(r"<!-- genrun export of (?P<name>.+?) -->\n(?P<body>.*?)<!-- end of (?P=name) -->\n", re.S)


@dataclass
class RowStats:
    """What the card says about the exported rows, gathered row by row during the export."""

    response_tokens: array = field(default_factory=lambda: array("q"))
    rewards: list[float] = field(default_factory=list)
    turns: array = field(default_factory=lambda: array("q"))
    agent_loops: Counter = field(default_factory=Counter)
    """Rows by the agent loop that made them (agent_name; None: the run's default loop)."""

    def add(self, response_tokens: int, reward: float | None, num_turns: int, agent_name: str | None = None) -> None:
        self.agent_loops[agent_name] += 1
        self.response_tokens.append(response_tokens)
        self.turns.append(num_turns)
        if reward is not None:
            self.rewards.append(reward)


def card_name(out_folder: StorageFolder, out_name: str) -> str:
    if out_folder.exists("README.md") and CARD_MARK not in out_folder.read_bytes("README.md").decode(errors="replace"):
        return f"{out_name}.README.md"
    return "README.md"


def write_dataset_card(
    out_folder: StorageFolder,
    out_name: str,
    record: RunRecord,
    counts: dict[str, int],
    filters: list[str],
    layout: str,
    stats: RowStats | list[str],
    agent_loops: Counter | None = None,
) -> str:
    """Write the card (see the module docstring) with this export's entry; returns its name in
    `out_folder`. `stats`: the exported trajectories' rewards and lengths, or (a layout whose rows
    are not trajectories) the Markdown lines that describe its rows instead, and then `agent_loops`
    counts its rows by agent loop (RowStats.agent_loops otherwise)."""
    name = card_name(out_folder, out_name)
    sections = {}
    if name == "README.md" and out_folder.exists(name):
        sections = card_sections(out_folder.read_bytes(name).decode(errors="replace"))
    # In place when the name is listed already (the default config stays the folder's first export).
    sections = {file: body for file, body in sections.items() if file == out_name or out_folder.exists(file)}
    loops = stats.agent_loops if isinstance(stats, RowStats) else agent_loops
    sections[out_name] = render_section(out_name, record, counts, filters, layout, stats, loops)
    out_folder.put_atomic(name, render_card(sections).encode())
    return name


@dataclass(frozen=True)
class RunProgress:
    """How far a run that is not finished got, when it was exported: its export holds part of
    the run, which the export's line (str) and its card's counts say."""

    committed: int
    planned: int
    shards_done: int
    shards: int

    def __str__(self) -> str:
        return (
            f"run not finished: {self.committed} of {self.planned} planned trajectories committed "
            f"({self.shards_done} of {self.shards} shards finished)"
        )

    def card_counts(self) -> dict[str, int]:
        return {
            "planned trajectories (run not finished)": self.planned,
            "finished shards (run not finished)": self.shards_done,
            "shards": self.shards,
        }


def unfinished_run(run_folder: StorageFolder, record: RunRecord) -> RunProgress | None:
    """The run's progress when a shard of it is not finished (outputs/status.py's shard states), else None."""
    states = shard_states(run_folder, record)
    done = sum(state["state"] == "done" for state in states)
    if done == len(states):
        return None
    return RunProgress(sum(s["committed"] for s in states), sum(s["expected"] for s in states), done, len(states))


def card_sections(card: str) -> dict[str, str]:
    """{data file: its section} of a card genrun wrote, in the card's order (a card of an earlier
    genrun, which held one file, gives that file and its text, headings moved one level down)."""
    sections = {match["name"]: match["body"] for match in _SECTION.finditer(card)}
    if sections or CARD_MARK not in card:
        return sections
    front = card.split(CARD_MARK, 1)[0]
    paths = [json.loads(path) if path.startswith('"') else path for path in re.findall(r"^ +path: (.+)$", front, re.M)]
    body = card.split(CARD_MARK, 1)[1].strip("\n")
    if not paths:
        return {}
    return {paths[0]: "\n".join(f"#{line}" if line.startswith("#") else line for line in body.splitlines()) + "\n"}


def config_names(file_names: list[str]) -> dict[str, str]:
    """The `datasets` config each export's file is loaded by: its name without the extension, or
    the whole name where two files share a stem."""
    stems = {name: (name.rpartition(".")[0] or name) if "." in name else name for name in file_names}
    return {name: stem if list(stems.values()).count(stem) == 1 else name for name, stem in stems.items()}


def render_card(sections: dict[str, str]) -> str:
    """The whole card: front matter with one config per file (the first the default), then the
    sections in order."""
    names = config_names(list(sections))
    front = ["tags:", "- genrun", "- synthetic", "configs:"]
    for position, file_name in enumerate(sections):
        # JSON strings are YAML strings: a file name with any character stays one value.
        front += [f"- config_name: {json.dumps(names[file_name])}", *(["  default: true"] if position == 0 else [])]
        front += ["  data_files:", "  - split: train", f"    path: {json.dumps(file_name)}"]
    first = next(iter(sections))
    others = [f'`load_dataset(folder, "{names[name]}")` reads {name}' for name in list(sections)[1:]]
    lines = [
        "---",
        *front,
        "---",
        CARD_MARK,
        "# genrun exports",
        "",
        "Rows generated by genrun and exported with `genrun export`, one section per file. "
        f"`datasets.load_dataset(folder)` reads {first} (the default config){'; ' + '; '.join(others) if others else ''}.",
        "",
    ]
    for file_name, body in sections.items():
        lines += [f"<!-- genrun export of {file_name} -->", body.rstrip("\n"), f"<!-- end of {file_name} -->"]
    return "\n".join(lines) + "\n"


def render_section(
    out_name: str,
    record: RunRecord,
    counts: dict[str, int],
    filters: list[str],
    layout: str,
    stats: RowStats | list[str],
    agent_loops: Counter | None = None,
) -> str:
    """One export's section of the card: the run that generated the rows, their counts, the filters and statistics."""
    config = record.config
    rollout = config.get("actor_rollout_ref", {}).get("rollout", {})
    model = config.get("actor_rollout_ref", {}).get("model", {}).get("path")
    seed = GenerationSettings.of(config).sample_seed
    files = [f.get("url") for f in (record.dataset or {}).get("files", [])]
    lines = [
        f"## {out_name}",
        "",
        f"Exported with `genrun export` (layout `{layout}`).",
        "",
        "### Generation",
        "",
        "| | |",
        "| --- | --- |",
        f"| model | `{model}` |",
        f"| engine | `{rollout.get('name')}` |",
        f"| sampling | temperature {rollout.get('temperature')}, top_p {rollout.get('top_p')}, top_k {rollout.get('top_k')}, "
        f"n {rollout.get('n')}, generation.sample_seed {seed if seed is not None else 'none'} |",
        f"| lengths | prompt at most {rollout.get('prompt_length')} tokens, response at most {rollout.get('response_length')} tokens |",
        f"| agent loop | {agent_loops_text(agent_loops or {}, rollout.get('agent', {}).get('default_agent_loop'))} |",
        f"| run fingerprint | `{record.fingerprint}` |",
        f"| genrun build | {describe_build(record.build)} |",
        f"| input | {', '.join(f'`{url}`' for url in files) or 'unknown'} ({(record.dataset or {}).get('num_rows', '?')} prompts) |",
        f"| run started | {record.created or 'unknown'} |",
        "",
        "### Rows",
        "",
        "| | |",
        "| --- | --- |",
        *(f"| {what} | {count} |" for what, count in counts.items()),
        "",
        "### Filters",
        "",
        *([f"- {line}" for line in filters] or ["- none: every committed trajectory"]),
        "",
        *(stats if isinstance(stats, list) else _trajectory_lines(stats)),
    ]
    return "\n".join(lines).rstrip("\n") + "\n"


def _trajectory_lines(stats: RowStats) -> list[str]:
    return [
        "### Rewards",
        "",
        _reward_lines(stats.rewards, len(stats.response_tokens)),
        "",
        "### Lengths",
        "",
        _distribution("response tokens", stats.response_tokens),
        _distribution("turns", stats.turns),
        "",
    ]


def pass_rate_lines(pass_rates: list[float], samples: list[int]) -> list[str]:
    """The rl-prompts layout's rows: one per prompt, described by its pass rate and samples."""
    return [
        "### Pass rates",
        "",
        _distribution_of("pass rate", pass_rates),
        _distribution("samples per prompt", samples),
        "",
    ]


def _distribution_of(what: str, values: list[float]) -> str:
    if not values:
        return f"- {what}: no rows"
    ordered = sorted(values)
    return (
        f"- {what}: mean {statistics.fmean(ordered):.3f}, median {statistics.median(ordered):.3f}, "
        f"min {ordered[0]:.3f}, max {ordered[-1]:.3f}"
    )


def _reward_lines(rewards: list[float], rows: int) -> str:
    if not rewards:
        return f"No exported row has a reward ({rows} rows)."
    spread = statistics.pstdev(rewards) if len(rewards) > 1 else 0.0
    positive = sum(r > 0 for r in rewards)
    return (
        f"{len(rewards)} of {rows} rows scored: mean {statistics.fmean(rewards):.4g}, std {spread:.4g}, "
        f"min {min(rewards):.4g}, max {max(rewards):.4g}; {positive} above 0."
    )


def _distribution(what: str, values: Any) -> str:
    if not len(values):
        return f"- {what}: no rows"
    ordered = sorted(values)

    def quantile(q: float) -> int:
        return int(ordered[min(int(q * len(ordered)), len(ordered) - 1)])

    return f"- {what}: mean {statistics.fmean(ordered):.1f}, median {quantile(0.5)}, p90 {quantile(0.9)}, min {ordered[0]}, max {ordered[-1]}"
