"""The report's plots, drawn with matplotlib's Agg canvas into PNG bytes (no display, no pyplot
state): the same images go into report.html, the Prefect artifacts and W&B."""

from __future__ import annotations

import base64
import io
import re
from dataclasses import dataclass
from typing import cast

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from generation_core.report.data import ReportData
from generation_core.report.stop_reasons import STOP_REASONS
from generation_core.store.run_folder import busy_spans

SOURCES_DRAWN = 8
"""Data sources drawn in the reward plot (the most frequent); the rest are pooled as "other"."""
_SIZE = (7.0, 3.6)
_DPI = 100
_COLORS = ["#2563eb", "#ea580c", "#16a34a", "#9333ea", "#dc2626", "#0891b2", "#ca8a04", "#db2777", "#64748b"]


@dataclass(frozen=True)
class Plot:
    name: str
    """A key: lowercase letters and dashes (Prefect artifact keys, W&B keys)."""
    title: str
    png: bytes

    @property
    def data_url(self) -> str:
        return "data:image/png;base64," + base64.b64encode(self.png).decode()


def _figure() -> Figure:
    figure = Figure(figsize=_SIZE, dpi=_DPI, layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def _png(figure: Figure) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    return buffer.getvalue()


def _bins(values: np.ndarray, most: int = 50) -> list[float]:
    """Integer-aligned bin edges for token counts."""
    low, high = int(values.min()), int(values.max())
    width = max(1, int(np.ceil((high - low + 1) / most)))
    return (np.arange(low, high + width + 1, width) - 0.5).tolist()


def response_lengths(data: ReportData) -> Plot:
    stats = data.stats
    figure = _figure()
    axes = figure.add_subplot()
    bins = _bins(np.concatenate([stats.response_tokens, stats.model_tokens]))
    axes.hist(stats.response_tokens, bins=bins, color=_COLORS[0], alpha=0.75, label="response tokens (all)")
    if (stats.model_tokens != stats.response_tokens).any():
        axes.hist(
            stats.model_tokens,
            bins=bins,
            histtype="step",
            linewidth=1.6,
            color=_COLORS[1],
            label="model tokens (response_mask 1)",
        )
    axes.axvline(
        data.limits.response_length,
        color="#475569",
        linestyle="--",
        linewidth=1,
        label=f"response_length = {data.limits.response_length}",
    )
    axes.set(
        xlabel="tokens per trajectory", ylabel="trajectories", title=f"Response length ({len(stats):,} trajectories)"
    )
    axes.legend(fontsize=8)
    return Plot("response-length", "Response length", _png(figure))


def _source_groups(data: ReportData) -> list[tuple[str, np.ndarray]]:
    rewarded = np.isfinite(data.stats.reward)
    counts = np.bincount(data.stats.source[rewarded], minlength=len(data.sources))
    order = [int(s) for s in np.argsort(-counts, kind="stable") if counts[s]]
    groups = [(data.sources[s], data.stats.reward[rewarded & (data.stats.source == s)]) for s in order[:SOURCES_DRAWN]]
    rest = order[SOURCES_DRAWN:]
    if rest:
        groups.append((f"other ({len(rest)} sources)", data.stats.reward[rewarded & np.isin(data.stats.source, rest)]))
    return groups


def rewards(data: ReportData) -> Plot | None:
    """Reward per data source: value counts when rewards take few values, histograms otherwise."""
    if not data.has_rewards:
        return None
    groups = _source_groups(data)
    values = np.unique(np.concatenate([rewards for _, rewards in groups]))
    figure = _figure()
    axes = figure.add_subplot()
    if len(values) <= 12:
        width = 0.8 / len(groups)
        for number, (source, group) in enumerate(groups):
            counts = [(group == value).sum() for value in values]
            positions = np.arange(len(values)) + (number - (len(groups) - 1) / 2) * width
            axes.bar(
                positions,
                counts,
                width=width,
                color=_COLORS[number % len(_COLORS)],
                label=f"{source} (n={len(group):,})",
            )
        axes.set_xticks(np.arange(len(values)), [f"{value:g}" for value in values])
    else:
        bins = np.linspace(values.min(), values.max(), 41).tolist()
        for number, (source, group) in enumerate(groups):
            axes.hist(
                group,
                bins=bins,
                histtype="step",
                linewidth=1.6,
                color=_COLORS[number % len(_COLORS)],
                label=f"{source} (n={len(group):,})",
            )
    axes.set(xlabel="reward", ylabel="trajectories", title="Reward per data source")
    axes.legend(fontsize=8)
    return Plot("reward", "Reward per data source", _png(figure))


def turns(data: ReportData) -> Plot:
    values, counts = np.unique(data.stats.num_turns, return_counts=True)
    figure = _figure()
    axes = figure.add_subplot()
    axes.bar(values, counts, color=_COLORS[2], width=0.7)
    if len(values) <= 20:
        axes.set_xticks(values, [str(v) for v in values])
    else:
        cast(MaxNLocator, axes.xaxis.get_major_locator()).set_params(integer=True)  # a bar plot's AutoLocator
    axes.set_xlim(values.min() - 1.5, values.max() + 1.5)
    axes.set(
        xlabel="turns per trajectory (user, assistant and tool turns)",
        ylabel="trajectories",
        title="Turns per trajectory",
    )
    return Plot("turns", "Turns per trajectory", _png(figure))


def stops(data: ReportData) -> Plot:
    counts = np.bincount(data.stats.stop.astype(np.int64), minlength=len(STOP_REASONS))
    labels = list(STOP_REASONS.values())
    total = counts.sum()
    figure = _figure()
    axes = figure.add_subplot()
    bars = axes.barh(np.arange(len(labels)), counts, color=_COLORS[3])
    axes.set_yticks(np.arange(len(labels)), labels)
    axes.invert_yaxis()
    axes.bar_label(bars, [f"{count:,} ({100 * count / total:.1f}%)" for count in counts], padding=3, fontsize=8)
    axes.set_xlim(0, max(counts.max() * 1.3, 1))
    axes.set(xlabel="trajectories", title="Why responses stopped")
    return Plot("stop-reasons", "Why responses stopped", _png(figure))


def _time_unit(span: float) -> tuple[float, str]:
    if span >= 2 * 3600:
        return 3600.0, "hours"
    if span >= 120:
        return 60.0, "minutes"
    return 1.0, "seconds"


def throughput(data: ReportData) -> Plot | None:
    """Trajectories committed over time (all shards), from the commit records' times."""
    events = data.commits
    if not any(event.trajectories for event in events):
        return None
    times = np.array([event.time for event in events])
    counts = np.array([event.trajectories for event in events])
    start = times.min()
    span = max(times.max() - start, 1e-3)
    scale, unit = _time_unit(span)
    figure = _figure()
    axes = figure.add_subplot()
    axes.step(
        (times - start) / scale,
        np.cumsum(counts),
        where="post",
        color=_COLORS[0],
        linewidth=1.8,
        label="committed (cumulative)",
    )
    axes.set(
        xlabel=f"{unit} since the first attempt started",
        ylabel="trajectories committed",
        title="Throughput over time (part commits)",
    )
    bins = np.linspace(0, span, min(30, max(2, len(events))) + 1)
    per_bin, _ = np.histogram(times - start, bins=bins, weights=counts)
    rate = axes.twinx()
    rate.bar(
        bins[:-1] / scale,
        per_bin / np.diff(bins),
        width=np.diff(bins) / scale,
        align="edge",
        color=_COLORS[1],
        alpha=0.3,
        label="rate",
    )
    rate.set_ylabel("trajectories / s")
    axes.set_zorder(rate.get_zorder() + 1)
    axes.patch.set_visible(False)
    handles = axes.get_legend_handles_labels()[0] + rate.get_legend_handles_labels()[0]
    axes.legend(handles, [str(h.get_label()) for h in handles], fontsize=8, loc="upper left")
    return Plot("throughput", "Throughput over time", _png(figure))


REPLICAS_DRAWN = 32
"""Replicas drawn in the timeline (the first, by id); a bigger pool's table has every one."""


def replica_label(name: str, width: int = 20) -> str:
    """A replica's whole name on lines of at most `width` characters, broken after `_ : / . -`
    where it can be (a cut name told two replicas of one run apart by nothing)."""
    lines = [""]
    for piece in re.split(r"(?<=[_:/.-])", str(name)):
        while piece:
            room = width - len(lines[-1])
            if len(piece) > room and lines[-1]:
                lines.append("")
                continue
            lines[-1] += piece[:width]
            piece = piece[width:]
            if piece:
                lines.append("")
    return "\n".join(lines)


def replica_timeline(data: ReportData) -> Plot | None:
    """Each replica's busy spans (a request running on it) over time, from the trajectories'
    per-turn provenance; the gaps are its idle time."""
    intervals = data.activity.intervals
    window = data.activity.window
    if not intervals or window is None:
        return None
    start, span = window[0], max(window[1] - window[0], 1e-3)
    scale, unit = _time_unit(span)
    replicas = sorted(intervals)[:REPLICAS_DRAWN]
    figure = _figure()
    axes = figure.add_subplot()
    for row, replica in enumerate(replicas):
        spans = busy_spans(intervals[replica])
        busy = sum(end - begin for begin, end in spans)
        axes.broken_barh(
            [((begin - start) / scale, max((end - begin) / scale, 1e-9)) for begin, end in spans],
            (row - 0.4, 0.8),
            color=_COLORS[row % len(_COLORS)],
            label=f"{replica}: busy {100 * busy / span:.0f}%",
        )
    axes.set_yticks(range(len(replicas)), [replica_label(r) for r in replicas])
    axes.set(xlabel=f"{unit} since the first request", title="Replicas busy (bars) and idle (gaps)")
    return Plot("replica-timeline", "Replicas busy and idle over time", _png(figure))


def time_split(data: ReportData) -> Plot | None:
    """Where the trajectories' time went, summed: slot wait, prefill, decode, tools, reward, storage."""
    split = {name: seconds for name, seconds in data.activity.time_split.items() if seconds > 0}
    if not split:
        return None
    total = sum(split.values())
    figure = _figure()
    axes = figure.add_subplot()
    names = list(split)
    axes.barh(names, [split[n] for n in names], color=[_COLORS[i % len(_COLORS)] for i in range(len(names))])
    for row, name in enumerate(names):
        axes.text(split[name], row, f" {100 * split[name] / total:.1f}%", va="center", fontsize=8)
    axes.invert_yaxis()
    axes.set(xlabel="seconds, summed over trajectories", title="Where the time went")
    return Plot("time-split", "Where the time went", _png(figure))


def all_plots(data: ReportData) -> list[Plot]:
    """Every plot the data allows (no rewards: no reward plot; no part commits: no throughput;
    no provenance: no replica timeline or time split)."""
    drawn = [
        response_lengths(data),
        rewards(data),
        turns(data),
        stops(data),
        throughput(data),
        replica_timeline(data),
        time_split(data),
    ]
    return [plot for plot in drawn if plot is not None]
