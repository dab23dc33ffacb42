"""Prefect task: publish the run (generation_core.publish.publish_run: zip, metrics, W&B
artifact) and show it in the Prefect UI (shard table and output location)."""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from generation_core.preflight import RunPlan
from generation_core.publish import publish_run
from generation_core.run_folder import ShardManifest
from generation_core.summary import shard_stats


@task(name="publish", cache_policy=NO_CACHE)
def publish(plan: RunPlan, summary: dict[str, Any], manifests: list[ShardManifest], artifact_key: str) -> dict[str, Any]:
    published = publish_run(plan.cfg, plan.folder, summary)
    create_table_artifact(key=f"{artifact_key}-shards", table=[shard_stats(m) for m in manifests], description="Per-shard statistics")
    lines = [
        f"# Trajectories: {summary['num_trajectories']}",
        f"- output folder: `{summary['output']}`",
        f"- merged DataProto: `{summary.get('artifact', 'not merged (generation.final_merge=false)')}`",
        f"- zip: `{published.get('zip', 'none')}`; W&B artifact: `{published.get('wandb_artifact', 'none')}`",
        f"- generated tokens: {summary['generated_tokens']}",
        f"- fingerprint: `{summary['fingerprint']}`",
    ]
    create_markdown_artifact(key=f"{artifact_key}-output", markdown="\n".join(lines), description="Where the run's output is")
    return dict(summary, published=published)
