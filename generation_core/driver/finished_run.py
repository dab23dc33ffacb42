"""Is there nothing left to do? A run whose every shard is finished and whose merged output and
report are current answers the same command again in seconds: no Prefect server, Ray or model
starts, nothing is rewritten (`genrun` asks before it starts anything).

Read only: no lease is taken and nothing is repaired. Whatever is not plainly finished (a shard
without its marker, one with failed samples, a part missing or of the wrong size, a manifest.json
that is unreadable or counts other shards, a merged file, chunk or zip missing or of another size
than the merge wrote, a merged layout other than generation.merge_chunk_size /
merge_max_file_bytes ask for, a report missing, a tracker to log to) goes the usual way, where
the run's lease, repair and merge decide. The answer names the folder given, not the one
manifest.json recorded (a copied run is the same run). Changed dataset rows under a finished
shard are refused here as they would be there (FinishedRowsChanged), before anything starts.
"""

from __future__ import annotations

import logging
from typing import Any, cast

from omegaconf import DictConfig, OmegaConf

from generation_core.config.settings import GenerationSettings
from generation_core.run_plan import DatasetFiles, RunPlan, plan_shards
from generation_core.shard.finished import check_rows_unchanged, finished_marker, rows_digest_reader
from generation_core.store.commit_log import ShardCheckpoint
from generation_core.store.folder import StorageFolder
from generation_core.store.merged_output import merge_chunk_rows, merged_output_damage
from generation_core.store.run_folder import (
    CHUNK_INDEX_FILE,
    MANIFEST_FILE,
    MERGED_FILE,
    REPORT_FILE,
    RUN_FILE,
    check_run_folder,
)

logger = logging.getLogger(__name__)


def finished_run(cfg: DictConfig, fingerprint: str, dataset: DatasetFiles) -> dict[str, Any] | None:
    """The run's manifest.json (with `report`: where report.html is) when the run in cfg's folder
    has nothing left to do, else None."""
    folder = StorageFolder(
        cfg.trainer.default_local_dir, cast(dict[str, Any], OmegaConf.to_container(cfg.storage.options))
    )
    try:
        finished_before = folder.exists(RUN_FILE) and folder.exists(MANIFEST_FILE)
    except Exception as exc:  # noqa: BLE001 - no credentials, a missing bucket: the planned run's folder check says which, in one line
        logger.debug("not asking whether %s is finished: %s: %s", folder.display(), type(exc).__name__, exc)
        return None
    if not finished_before:
        return None
    # Another run's folder is refused here, as the planned run would refuse it.
    record = check_run_folder(folder, fingerprint)
    if record is None or record.pad_token_id is None or _logs_to_a_tracker(cfg):
        return None
    plan = RunPlan(
        cfg,
        fingerprint,
        plan_shards(dataset.num_rows, GenerationSettings.of(cfg).num_shards),
        record.pad_token_id,
        dataset,
    )
    markers, recorded_digests = [], {}
    for shard in plan.shards:
        checkpoint = ShardCheckpoint.load(folder, shard.name)
        marker = finished_marker(folder, shard.name, checkpoint)
        if marker is None:
            return None
        markers.append(marker)
        recorded_digests[shard.shard_id] = checkpoint.rows_digest
    manifest = _read_manifest(folder)
    if manifest is None or manifest.get("num_trajectories") != sum(m.num_trajectories for m in markers):
        return None
    if manifest.get("fingerprint") != fingerprint or not folder.exists(REPORT_FILE):
        return None
    # The folder given, not the one manifest.json recorded: a copied or moved run is the same run.
    answer = dict(manifest, output=folder.display(), report=folder.display(REPORT_FILE))
    answer.pop("artifact", None)
    answer["merged"] = "not merged (generation.final_merge=false)"
    if plan.settings.final_merge or "artifact" in manifest:
        entry = _current_merged_output(folder, manifest, plan.settings)
        if entry is None:
            return None
        answer.update(artifact=folder.display(entry), merged="merged output current")
    _check_rows_unchanged(plan, recorded_digests)
    return answer


def _read_manifest(folder: StorageFolder) -> dict[str, Any] | None:
    """manifest.json, or None when it does not hold a JSON object (cut, or overwritten): the run
    is then not plainly finished, and the usual path writes it again."""
    try:
        manifest = folder.read_json(MANIFEST_FILE)
    except ValueError as exc:  # invalid JSON or UTF-8
        logger.debug("%s is unreadable: %s", folder.display(MANIFEST_FILE), exc)
        return None
    return manifest if isinstance(manifest, dict) else None


def _current_merged_output(folder: StorageFolder, manifest: dict[str, Any], settings: GenerationSettings) -> str | None:
    """The merged output's entry file (trajectories.pkl or trajectories.json) when the output and
    zip manifest.json describes are on disk whole and in the layout the current settings ask for
    (generation.merge_chunk_size, merge_max_file_bytes); else None."""
    rows, row_bytes = manifest.get("merged_rows"), manifest.get("padded_row_bytes")
    if "artifact" not in manifest or rows != manifest["num_trajectories"] or not isinstance(row_bytes, int):
        return None
    chunk_rows = merge_chunk_rows(rows, max(row_bytes, 1), settings.merge_chunk_size, settings.merge_max_file_bytes)
    damage = merged_output_damage(folder, manifest, chunk_rows)
    if damage is not None:
        logger.info("merging again: %s", damage)
        return None
    return MERGED_FILE if chunk_rows is None else CHUNK_INDEX_FILE


def _check_rows_unchanged(plan: RunPlan, recorded_digests: dict[int, str | None]) -> None:
    """Every shard's rows are those it was generated from (shard/finished.py's check)."""
    for shard in plan.shards:
        check_rows_unchanged(plan.folder, shard, recorded_digests[shard.shard_id], rows_digest_reader(plan, shard))


def _logs_to_a_tracker(cfg: DictConfig) -> bool:
    """W&B and verl's other trackers are logged to at publish time, which a rerun must redo."""
    return any(backend != "console" for backend in cfg.trainer.logger)
