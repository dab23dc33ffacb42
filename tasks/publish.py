"""Prefect task: publish the run (generation_core.driver.publish.publish_run: zip, report, metrics, W&B
artifact) and show it in the Prefect UI (shard table, output location, the report's plots)."""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.artifacts import create_image_artifact, create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE

from generation_core.driver.publish import publish_run
from generation_core.outputs.summary import shard_stats
from generation_core.report.html import Report
from generation_core.run_plan import RunPlan
from generation_core.store.lease import LeaseFence
from generation_core.store.run_folder import SuccessMarker


@task(name="publish", cache_policy=NO_CACHE)
def publish(
    plan: str,
    summary: dict[str, Any],
    markers: list[SuccessMarker],
    artifact_key: str,
    fence: LeaseFence | None = None,
) -> dict[str, Any]:
    """`plan`: the run's plan as JSON text (RunPlan.to_json), as every task of the flow takes it."""
    run_plan = RunPlan.from_json(plan)
    published = publish_run(
        run_plan.cfg,
        run_plan.folder,
        summary,
        on_report=lambda report: report_artifacts(report, artifact_key),
        fence=fence,
        settings=run_plan.settings,
    )
    create_table_artifact(
        key=f"{artifact_key}-shards", table=[shard_stats(m) for m in markers], description="Per-shard statistics"
    )
    lines = [
        f"# Trajectories: {summary['num_trajectories']}",
        f"- output folder: `{summary['output']}`",
        f"- merged DataProto: `{summary.get('artifact', 'not merged (generation.final_merge=false)')}`",
        f"- zip: `{published.get('zip', 'none')}`; W&B artifact: `{published.get('wandb_artifact', 'none')}`",
        f"- report (plots, failures, trajectory viewer): `{published.get('report', 'none')}`",
        f"- generated tokens: {summary['generated_tokens']}",
        f"- fingerprint: `{summary['fingerprint']}`",
    ]
    create_markdown_artifact(
        key=f"{artifact_key}-output", markdown="\n".join(lines), description="Where the run's output is"
    )
    return dict(summary, published=published)


def report_artifacts(report: Report, artifact_key: str) -> None:
    """The report's plots in the flow run's Artifacts tab: one image artifact per plot and one
    markdown artifact with all of them (both inline PNG data URLs: nothing to host)."""
    for plot in report.plots:
        create_image_artifact(image_url=plot.data_url, key=f"{artifact_key}-{plot.name}", description=plot.title)
    create_markdown_artifact(
        key=f"{artifact_key}-report", markdown=report.markdown(), description=f"Run report: {report.location}"
    )
