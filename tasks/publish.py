"""Prefect task: show the run in the Prefect UI (shard table and output location)."""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from generation_core.run import shard_stats


@task(name="publish", cache_policy=NO_CACHE)
def publish(summary: dict[str, Any], manifests: list[dict[str, Any]], artifact_key: str) -> None:
    create_table_artifact(key=f"{artifact_key}-shards", table=[shard_stats(m) for m in manifests], description="Per-shard statistics")
    lines = [
        f"# Trajectories: {summary['num_trajectories']}",
        f"- output folder: `{summary['output']}`",
        f"- merged DataProto: `{summary.get('artifact', 'not merged (generation.final_merge=false)')}`",
        f"- generated tokens: {summary['generated_tokens']}",
        f"- fingerprint: `{summary['fingerprint']}`",
    ]
    create_markdown_artifact(key=f"{artifact_key}-output", markdown="\n".join(lines), description="Where the run's output is")
