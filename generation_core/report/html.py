"""The run report: one self-contained report.html in the run folder (plots inline as PNG, the
trajectory viewer's data and script inline), written by `genrun report RUN_DIR` and at the end
of every run (publish.py). Works on any run folder genrun can read, local or s3://."""

from __future__ import annotations

import html
import time
from dataclasses import dataclass
from importlib import resources
from typing import Any

import numpy as np

from generation_core.build import describe_build, same_build
from generation_core.outputs.summary import agent_loops_text, reward_figures
from generation_core.report.data import ReportData, collect_report_data
from generation_core.report.plots import Plot, all_plots
from generation_core.report.viewer import TOKEN_BUDGET, eos_token_ids, load_tokenizer, payload_json, viewer_payload
from generation_core.store.folder import StorageFolder
from generation_core.store.run_folder import REPORT_FILE, read_run_record

SAMPLE_SIZE = 500
"""Trajectories the viewer holds at most (`genrun report --sample N`); the page says how many of how many."""
CAPACITY_PLOTS = ("replica-timeline", "time-split")
"""Plots shown in the Capacity section, beside the ledger, instead of among the other plots."""


@dataclass
class Report:
    location: str
    """Where report.html was written (URL form)."""
    trajectories: int
    shown: int
    """Trajectories in the viewer."""
    plots: list[Plot]
    rewards: dict[str, Any] | None = None
    """outputs/summary.reward_figures of every committed trajectory (None: none is scored)."""

    def markdown(self) -> str:
        """The plots as markdown (a Prefect artifact), images inline."""
        lines = [
            "# Run report",
            f"`{self.location}`: {self.trajectories:,} trajectories, {self.shown:,} in its trajectory viewer",
            "",
        ]
        for plot in self.plots:
            lines += [f"## {plot.title}", f"![{plot.title}]({plot.data_url})", ""]
        return "\n".join(lines)


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _asset(name: str) -> str:
    return (resources.files("generation_core.report") / "assets" / name).read_text(encoding="utf-8")


def _facts(data: ReportData) -> list[tuple[str, str]]:
    run, stats = data.run, data.stats
    config = run.config
    rollout = config["actor_rollout_ref"]["rollout"]
    rewarded = np.isfinite(stats.reward)
    facts = [
        ("trajectories", f"{len(stats):,}"),
        ("model tokens", f"{int(stats.model_tokens.sum()):,}"),
        ("mean response length", f"{stats.response_tokens.mean():.1f} tokens"),
        (
            "mean reward",
            f"{stats.reward[rewarded].mean():.4g} ({rewarded.sum():,} rewarded)" if rewarded.any() else "no rewards",
        ),
        ("failed samples (logged)", f"{data.failure_count:,}"),
        ("shards", f"{len(data.shards):,}"),
        ("model", str(config["actor_rollout_ref"]["model"]["path"])),
        ("engine", str(rollout.get("name"))),
        ("agent loop", agent_loops_text(data.agent_loops, (rollout.get("agent") or {}).get("default_agent_loop"))),
        ("samples per prompt (n)", str(run.samples_per_prompt)),
        ("temperature", str(rollout.get("temperature"))),
        ("prompt / response length", f"{data.limits.prompt_length} / {data.limits.response_length}"),
        ("dataset", ", ".join(f["url"] for f in (run.dataset or {}).get("files", [])) or "?"),
        ("created", str(run.created if run.created is not None else "?")),
        ("genrun", describe_build(run.build) if run.build else str(run.versions.get("genrun", "?"))),
        ("fingerprint", str(run.fingerprint if run.fingerprint is not None else "")[:16]),
    ]
    # Attempts run by another build than the one that took the folder (build.py: same output format).
    later: list[dict[str, Any]] = []
    for build in (b for shard in data.shards for b in shard.get("builds", [])):
        if not same_build(build, run.build) and not any(same_build(build, seen) for seen in later):
            later.append(build)
    if later:
        facts.append(("attempts also by", "; ".join(describe_build(b) for b in later)))
    return facts


def _plots_section(data: ReportData, plots: list[Plot]) -> str:
    figures = "".join(
        f'<figure><img alt="{_e(p.title)}" src="{p.data_url}"><figcaption>{_e(p.title)}</figcaption></figure>'
        for p in plots
        if p.name not in CAPACITY_PLOTS
    )
    drawn = {p.name for p in plots}
    notes = []
    if "reward" not in drawn:
        notes.append(
            "No reward plot: no trajectory of this run has a reward (reward.custom_reward_function or the agent loop gives one)."
        )
    if "throughput" not in drawn:
        notes.append("No throughput plot: no part commit records with times.")
    return f'<section id="plots"><h2>Plots</h2><div class="plots">{figures}</div>{"".join(f"<p class=note>{_e(n)}</p>" for n in notes)}</section>'


def _capacity_section(data: ReportData, plots: list[Plot]) -> str:
    """The capacity ledger (manifest.json's, once the run finished) beside the replica timeline
    and the time split charts."""
    ledger = data.ledger
    figures = "".join(
        f'<figure><img alt="{_e(p.title)}" src="{p.data_url}"><figcaption>{_e(p.title)}</figcaption></figure>'
        for p in plots
        if p.name in CAPACITY_PLOTS
    )
    if not ledger:
        body = "<p class=note>No capacity ledger yet: manifest.json has none until the run finishes (the charts come from the trajectories committed so far).</p>"
    else:
        on_gpus = bool(ledger.get("gpus_per_replica"))
        replicas = (
            f"{ledger['replicas']} x {ledger['gpus_per_replica']} GPU(s)"
            if on_gpus
            else f"{ledger['replicas']} on the CPU"
        )
        facts = [
            ("wall time", f"{ledger['wall_seconds']:,.1f} s"),
            ("replicas", replicas),
            ("replica-seconds", f"{ledger['replica_seconds']:,.1f}"),
        ]
        if on_gpus:
            facts.append(("GPU-seconds", f"{ledger['gpu_seconds']:,.1f}"))
        facts.append(("output tokens", f"{ledger['output_tokens']:,}"))
        if ledger.get("prefix_cache_hit_rate") is not None:
            facts.append(("prefix-cache hit rate", f"{100 * ledger['prefix_cache_hit_rate']:.1f}%"))
        if ledger.get("cost") is not None:
            per_million = ledger.get("cost_per_million_output_tokens")
            facts.append(("cost", f"{ledger['cost']:.4g} ({ledger['gpu_hour_price']:g} per GPU-hour)"))
            facts.append(("cost per 1M output tokens", "n/a" if per_million is None else f"{per_million:.4g}"))
        rows = "".join(
            f"<tr><td>{_e(replica)}</td><td class=num>{row['requests']:,}</td><td class=num>{row['output_tokens']:,}</td>"
            f"<td class=num>{row['tokens_per_second']:,.1f}</td><td class=num>{100 * row['idle_fraction']:.1f}%</td></tr>"
            for replica, row in (ledger.get("per_replica") or {}).items()
        )
        body = (
            f'<dl class="facts">{"".join(f"<div><dt>{_e(k)}</dt><dd>{_e(v)}</dd></div>" for k, v in facts)}</dl>'
            f'<table id="replica-table"><thead><tr><th>replica</th><th class=num>requests</th><th class=num>output tokens</th>'
            f"<th class=num>tokens/s</th><th class=num>idle</th></tr></thead><tbody>{rows}</tbody></table>"
        )
    return f'<section id="capacity"><h2>Capacity</h2>{body}<div class="plots">{figures}</div></section>'


def _shards_section(data: ReportData) -> str:
    columns = [
        ("shard", "shard", False),
        ("rows", "range", False),
        ("state", "state", False),
        ("committed", "committed", True),
        ("expected", "expected", True),
        ("failed", "failed_samples", True),
        ("parts", "parts", True),
        ("model tokens", "generated_tokens", True),
        ("attempts", "attempts", True),
    ]
    head = (
        "".join(f'<th class="{"num" if num else ""}">{_e(title)}</th>' for title, _, num in columns)
        + "<th>last error</th>"
    )
    rows = []
    for shard in data.shards:
        cells = []
        for _, key, num in columns:
            value = shard.get(key, "")
            if key == "range" and isinstance(value, list):
                value = f"{value[0]}–{value[1]}"
            css = "num" if num else (f"state-{value}" if key == "state" else "")
            cells.append(f'<td class="{css}">{_e(f"{value:,}" if isinstance(value, int) else value)}</td>')
        cells.append(f"<td>{_e(shard.get('error') or '')}</td>")
        rows.append(f"<tr>{''.join(cells)}</tr>")
    return f'<section id="shards"><h2>Shards</h2><table id="shard-table"><thead><tr>{head}</tr></thead><tbody>{"".join(rows)}</tbody></table></section>'


def _failures_section(data: ReportData) -> str:
    if not data.failure_count:
        return '<section id="failures"><h2>Failures</h2><p class="note">No sample failed.</p></section>'
    kinds = "".join(
        f'<tr><td class="num">{count:,}</td><td><code>{_e(error)}</code></td></tr>'
        for error, count in data.failure_kinds.most_common(20)
    )
    rows = []
    for failure in data.failures:
        status = "generated on a later attempt" if failure.recovered else "not generated"
        trace = (
            f"<details><summary>traceback</summary><pre>{_e(failure.traceback)}</pre></details>"
            if failure.traceback
            else ""
        )
        rows.append(
            f"<tr><td>{_e(failure.shard)}</td><td class=mono>{failure.index}:{failure.rollout_n}</td><td>{_e(status)}</td><td><code>{_e(failure.error)}</code>{trace}</td></tr>"
        )
    more = (
        f"<p class=note>The first {len(data.failures):,} of {data.failure_count:,} are listed; every shard's failures/ folder has all of them.</p>"
        if data.failure_count > len(data.failures)
        else ""
    )
    return (
        f'<section id="failures"><h2>Failures</h2><p>{data.failure_count:,} failure log line(s) (every attempt\'s; a sample a later attempt generated counts too).</p>'
        f"<table><thead><tr><th class=num>count</th><th>error</th></tr></thead><tbody>{kinds}</tbody></table><h3>Samples</h3>"
        f'<table id="failure-table"><thead><tr><th>shard</th><th>sample</th><th>now</th><th>error</th></tr></thead><tbody>{"".join(rows)}</tbody></table>{more}</section>'
    )


def _viewer_section(payload: dict[str, Any], sample_size: int) -> str:
    shown, total = len(payload["trajectories"]), payload["total"]
    if shown < total:
        how = (
            f"Showing {shown:,} of {total:,} trajectories: a uniform sample by sample id (the same on every report of this run), at most "
            f"{sample_size:,} and {TOKEN_BUDGET:,} tokens; `genrun report DIR --sample N` holds more. Filters apply to the sample."
        )
    else:
        how = f"All {total:,} trajectories."
    if not payload["decoded"]:
        how += (
            " The run's tokenizer was not loaded (not on the machine that wrote this report, or it is code from the model folder, which runs "
            "only with genrun report DIR --trust-remote-code): tokens are shown as ids."
        )
    filters = (
        '<label>reward ≥<input id="f-reward-min" type="number" step="any"></label><label>reward ≤<input id="f-reward-max" type="number" step="any"></label>'
        '<label>data source<select id="f-source"><option value="">all</option></select></label>'
        '<label>length ≥ (tokens)<input id="f-length-min" type="number" min="0"></label><label>length ≤ (tokens)<input id="f-length-max" type="number" min="0"></label>'
        '<label>stopped<select id="f-stop"><option value="">any</option></select></label>'
        '<label>replica<select id="f-replica"><option value="">any</option></select></label>'
        '<label>sort by<select id="f-sort"><option value="">sample id</option><option value="total">total time</option>'
        '<option value="slot_wait">slot wait</option><option value="prefill">prefill</option><option value="decode">decode</option>'
        '<option value="tools">tool calls</option><option value="reward">reward function</option></select></label>'
        '<label><input id="f-slowest" type="checkbox">slowest 1%</label><span id="shown-count"></span>'
    )
    return (
        f'<section id="viewer"><h2>Trajectories</h2><p id="viewer-sample" data-shown="{shown}" data-total="{total}">{_e(how)}</p>'
        f'<div class="filters">{filters}</div><div class="viewer"><div id="traj-list"></div><div id="traj-detail"></div></div>'
        f'<script type="application/json" id="viewer-data">{payload_json(payload)}</script><script>{_asset("viewer.js")}</script></section>'
    )


def render_html(data: ReportData, plots: list[Plot], payload: dict[str, Any], sample_size: int) -> str:
    facts = "".join(f"<div><dt>{_e(k)}</dt><dd>{_e(v)}</dd></div>" for k, v in _facts(data))
    warnings = "".join(
        f"<p class=warn>Part {_e(path)} does not match its checksum: left out of this report.</p>"
        for path in data.skipped_parts
    )
    generated = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    return (
        "<!DOCTYPE html>\n"
        f'<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>genrun report: {_e(data.location)}</title><style>{_asset('report.css')}</style></head><body>"
        f'<header><h1>Run report</h1><p class="where">{_e(data.location)} · written {generated}</p><dl class="facts">{facts}</dl>{warnings}</header>'
        '<nav><a href="#plots">Plots</a><a href="#capacity">Capacity</a><a href="#shards">Shards</a><a href="#failures">Failures</a><a href="#viewer">Trajectories</a></nav>'
        f"{_plots_section(data, plots)}{_capacity_section(data, plots)}{_shards_section(data)}{_failures_section(data)}{_viewer_section(payload, sample_size)}"
        "</body></html>\n"
    )


def write_report(folder: StorageFolder, sample_size: int = SAMPLE_SIZE, trust_remote_code: bool = False) -> Report:
    """Collect, draw and write report.html into the run folder (one atomic put). Code from the
    run's model folder runs only with `trust_remote_code` (the user's --trust-remote-code)."""
    run = read_run_record(folder)
    tokenizer = load_tokenizer(run, trust_remote_code)
    data = collect_report_data(folder, run, eos_token_ids(run, tokenizer), sample_size)
    plots = all_plots(data)
    payload = viewer_payload(data, tokenizer)
    folder.put_atomic(REPORT_FILE, render_html(data, plots, payload, sample_size).encode())
    return Report(
        folder.display(REPORT_FILE),
        len(data.stats),
        len(payload["trajectories"]),
        plots,
        reward_figures(data.stats.reward),
    )


def report_command(
    url: str, storage_options: dict[str, Any], sample_size: int = SAMPLE_SIZE, trust_remote_code: bool = False
) -> int:
    """`genrun report DIR`: write the report and say where it is."""
    report = write_report(StorageFolder(url, storage_options), sample_size, trust_remote_code)
    print(f"report: {report.location} ({report.trajectories:,} trajectories; the viewer holds {report.shown:,})")
    return 0
