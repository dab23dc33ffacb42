"""Finish a run: merge the committed parts as configured and write manifest.json (the summary);
and `genrun merge DIR` (`merge_folder`), the same merge on demand."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

from generation_core.config.layout import resolve_layout
from generation_core.config.settings import GenerationSettings
from generation_core.errors import GenrunError
from generation_core.instrumentation import failpoint
from generation_core.outputs.ledger import capacity_ledger, replica_activity
from generation_core.outputs.merge import check_shard_counts, merge_output
from generation_core.outputs.padding import Padding
from generation_core.outputs.summary import latency_percentiles, summarize
from generation_core.run_plan import RunPlan
from generation_core.store.fencing import fenced
from generation_core.store.folder import StorageFolder
from generation_core.store.lease import LeaseFence, RunLease
from generation_core.store.part_repair import DamagedPart, mark_for_repair
from generation_core.store.run_folder import MANIFEST_FILE, RUN_FILE, SuccessMarker, read_run_record

T = TypeVar("T")
logger = logging.getLogger(__name__)


def padding_of(rollout: Any, pad_token_id: int) -> Padding:
    """The run's padding from its rollout config (a DictConfig or run.json's plain dict)."""
    return Padding(
        prompt_length=int(rollout["prompt_length"]),
        response_length=int(rollout["response_length"]),
        pad_token_id=int(pad_token_id),
    )


def finish_run(
    plan: RunPlan,
    markers: list[SuccessMarker],
    elapsed: float,
    fence: LeaseFence | None = None,
) -> dict[str, Any]:
    """Check that every shard accounts for its planned rows (merge.check_shard_counts), merge
    (when configured) and write the run's manifest.json; returns the summary. `fence`: the run's
    lease: the merged files and manifest.json are published only while it holds (else LeaseLost),
    and a damaged part found by the merge is dropped under it."""
    failpoint("merge")
    check_shard_counts(markers, plan.cfg.actor_rollout_ref.rollout.n, plan.settings.adaptive)
    summary = summarize(plan, markers, elapsed)
    # Every file below is published only while the run still holds the folder.
    folder = fenced(plan.folder, fence)
    gen = plan.settings
    if gen.final_merge:
        padding = padding_of(plan.cfg.actor_rollout_ref.rollout, plan.pad_token_id)
        merged = merge_repairing(
            folder,
            lambda: merge_output(folder, padding, gen.merge_chunk_size, gen.merge_max_file_bytes),
            fence,
        )
        # The run's terminal says so once; `genrun merge` prints its own line (merge_folder).
        logger.info("merged %d trajectories into %s", merged.rows, folder.display(merged.entry_file))
        summary["artifact"] = folder.display(merged.entry_file)
        summary["merged_rows"] = merged.rows
        # What a rerun checks the merged output against (driver/finished_run.py): without reading it.
        summary["merged_bytes"] = merged.bytes
        summary["padded_row_bytes"] = merged.padded_row_bytes
        summary["request_latency_s"] = latency_percentiles(merged.generate_seconds)
    summary["ledger"] = run_ledger(plan, summary, markers, elapsed)
    folder.put_json(MANIFEST_FILE, summary)
    return summary


def run_ledger(plan: RunPlan, summary: dict[str, Any], markers: list[SuccessMarker], elapsed: float) -> dict[str, Any]:
    """The run's capacity ledger (outputs/ledger.py): this invocation's wall time and replicas,
    the counters of every part the shards' markers list (no trajectory is read)."""
    layout = resolve_layout(plan.cfg)
    parts = (part for marker in markers for part in marker.parts)
    activity = replica_activity(parts, since=time.time() - elapsed)
    return capacity_ledger(
        activity,
        wall_seconds=elapsed,
        replicas=layout.replicas,
        gpus_per_replica=layout.gpus_per_replica,
        output_tokens=summary["this_invocation"]["generated_tokens"],
        gpu_hour_price=plan.settings.gpu_hour_price,
    )


def merge_repairing(folder: StorageFolder, merge: Callable[[], T], fence: LeaseFence | None = None) -> T:
    """Run `merge`; a part it finds damaged is dropped from its shard's checkpoint, so that
    running the same command again regenerates exactly its samples, and the error says so."""
    try:
        return merge()
    except DamagedPart as damaged:
        mark_for_repair(folder, damaged, fence)
        raise GenrunError(
            f"{damaged}; its samples were dropped from the shard's checkpoint: run the same command again to regenerate them and merge"
        ) from None


def merge_folder(url: str, storage_options: dict[str, Any] | None = None) -> None:
    """Rebuild the merged output from the committed parts, chunked when the run's config says so."""
    folder = StorageFolder(url, storage_options)
    run = read_run_record(folder)
    if run.pad_token_id is None:
        raise GenrunError(
            f"{folder.display(RUN_FILE)} records no pad_token_id: this genrun cannot pad its trajectories"
        )
    generation = GenerationSettings.of(run.config)
    padding = padding_of(run.rollout, run.pad_token_id)
    # Not beside a run that is still writing parts (its own merge would follow anyway).
    with RunLease.acquire(folder, generation.lease_seconds) as lease:
        writing = fenced(folder, lease.fence())
        output = merge_repairing(
            writing,
            lambda: merge_output(writing, padding, generation.merge_chunk_size, generation.merge_max_file_bytes),
            lease.fence(),
        )
    print(f"merged {output.rows} trajectories into {folder.display(output.entry_file)}")
