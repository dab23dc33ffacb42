"""The run summary: per-shard stats that merge into run totals (manifest.json, the CLI's last
lines, the Prefect shard table, tracker metrics). Rates are computed here and nowhere else."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any

import numpy as np

from generation_core.run_plan import RunPlan
from generation_core.store.run_folder import SuccessMarker


def shard_stats(marker: SuccessMarker) -> dict[str, Any]:
    """One row of the per-shard table (Prefect artifact, manifest.json)."""
    return {
        "shard": marker.shard,
        "samples": marker.num_trajectories,
        "tokens": marker.generated_tokens,
        "tokens_per_s": marker.tokens_per_second,
        "failures": marker.failures,
        "attempts": marker.attempts,
        "retries": max(marker.attempts - 1, 0),
    }


def summarize(plan: RunPlan, markers: list[SuccessMarker], elapsed: float) -> dict[str, Any]:
    generated_now = sum(m.last_attempt.trajectories for m in markers)
    shard_seconds = sum(m.last_attempt.seconds for m in markers)
    tokens_now = sum(m.last_attempt.generated_tokens for m in markers)
    return {
        "fingerprint": plan.fingerprint,
        "output": plan.folder.display(),
        "num_trajectories": sum(m.num_trajectories for m in markers),
        "generated_tokens": sum(m.generated_tokens for m in markers),
        "failed_samples": sum(m.failures for m in markers),
        # Samples adaptive sampling decided not to draw (generation.adaptive): not owed, not missing.
        "not_needed": sum(m.not_owed for m in markers),
        "retries": sum(max(m.attempts - 1, 0) for m in markers),
        # Each shard filters its own rows (shard_rows.DatasetPrompts); a finished shard's marker keeps its count.
        "filtered_overlong_prompts": sum(m.filtered_overlong for m in markers),
        "replica_failures": sum(m.last_attempt.engine.get("replica_failures", 0) for m in markers),
        # Damaged parts found over the run's life, dropped and regenerated (part_repair.repair_damaged_parts).
        "repaired_parts": [dict(repair, shard=m.shard) for m in markers for repair in m.repaired_parts],
        "this_invocation": {
            "trajectories": generated_now,
            "generated_tokens": tokens_now,
            "generation_seconds": round(shard_seconds, 3),
            "trajectories_per_second": round(generated_now / shard_seconds, 2) if shard_seconds else 0.0,
            "tokens_per_second": round(tokens_now / shard_seconds, 2) if shard_seconds else 0.0,
            "wall_seconds": round(elapsed, 3),
        },
        "shards": [shard_stats(m) for m in markers],
    }


def reward_figures(rewards: np.ndarray) -> dict[str, Any] | None:
    """What the terminal says of a run's rewards (one per trajectory, NaN where unscored): how
    many are scored, their mean, the highest and how many reached it; None when none is."""
    scored = rewards[np.isfinite(rewards)]
    if not len(scored):
        return None
    highest = float(scored.max())
    return {
        "trajectories": int(len(rewards)),
        "scored": int(len(scored)),
        "mean": round(float(scored.mean()), 4),
        "max": round(highest, 4),
        "at_max": int((scored == highest).sum()),
    }


def reward_line(figures: dict[str, Any]) -> str:
    """reward_figures in a few words: `96 scored, mean 0.02, 2 at 1.0 (the highest)`."""
    scored = f"{figures['scored']:,}" + (
        f" of {figures['trajectories']:,}" if figures["scored"] != figures["trajectories"] else ""
    )
    return f"{scored} scored, mean {figures['mean']:.3g}, {figures['at_max']:,} at {figures['max']} (the highest)"


def agent_loops_text(counts: Mapping[str | None, int], default: str | None) -> str:
    """The agent loops rows ran, most used first, with counts: `tool_agent (96)`. A row without
    an `agent_name` (None; parts written before genrun kept it) ran `default`, the run's
    rollout.agent.default_agent_loop."""
    merged: Counter[str] = Counter()
    for name, count in counts.items():
        merged[str(name if name is not None else default)] += count
    if not merged:
        return str(default)
    return ", ".join(f"{name} ({count:,})" for name, count in merged.most_common())


def latency_percentiles(latencies: np.ndarray) -> dict[str, float]:
    """p50/p95 of the time each trajectory spent waiting on the engine (verl's generate_sequences)."""
    if len(latencies) == 0:
        return {}
    return {"p50": round(float(np.percentile(latencies, 50)), 4), "p95": round(float(np.percentile(latencies, 95)), 4)}


def throughput_metrics(summary: dict[str, Any]) -> dict[str, float]:
    """The summary's figures under tracker metric names."""
    now = summary["this_invocation"]
    metrics = {
        "generation/trajectories": float(summary["num_trajectories"]),
        "generation/generated_tokens": float(summary["generated_tokens"]),
        "generation/samples_per_s": float(now["trajectories_per_second"]),
        "generation/tokens_per_s": float(now["tokens_per_second"]),
        "generation/failures": float(summary["failed_samples"]),
        "generation/retries": float(summary["retries"]),
    }
    for name, value in summary.get("request_latency_s", {}).items():
        metrics[f"generation/request_latency_{name}_s"] = float(value)
    metrics.update(ledger_metrics(summary.get("ledger") or {}))
    return metrics


def ledger_metrics(ledger: dict[str, Any]) -> dict[str, float]:
    """The capacity ledger (outputs/ledger.py) under tracker metric names."""
    if not ledger:
        return {}
    metrics = {
        f"ledger/{name}": float(ledger[name])
        for name in ("wall_seconds", "replica_seconds", "gpu_seconds")
        if ledger.get(name) is not None
    }
    for name, seconds in (ledger.get("time_split_seconds") or {}).items():
        metrics[f"ledger/time_split/{name}_s"] = float(seconds)
    for replica, row in (ledger.get("per_replica") or {}).items():
        metrics[f"ledger/replica/{replica}/tokens_per_s"] = float(row["tokens_per_second"])
        metrics[f"ledger/replica/{replica}/idle_fraction"] = float(row["idle_fraction"])
    for name in ("prefix_cache_hit_rate", "cost", "cost_per_million_output_tokens"):
        if ledger.get(name) is not None:
            metrics[f"ledger/{name}"] = float(ledger[name])
    return metrics
