"""Publish a finished run: trajectories.zip, the run report (report.html, its plots also in W&B),
throughput metrics through verl's Tracking, and the W&B artifact (uploaded, or as references to
the S3 objects)."""

from __future__ import annotations

import dataclasses
import io
import logging
import os
import shutil
import tempfile
import zipfile
from collections.abc import Callable
from typing import Any, cast

from omegaconf import DictConfig, OmegaConf
from verl.utils.tracking import Tracking

from generation_core.config.settings import GenerationSettings
from generation_core.errors import GenrunError
from generation_core.outputs.summary import throughput_metrics
from generation_core.report.html import Report, write_report
from generation_core.secrets import without_secrets
from generation_core.store.fencing import Fence, fenced
from generation_core.store.folder import StorageFolder
from generation_core.store.run_folder import MANIFEST_FILE, MERGED_FILE, RUN_FILE, ZIP_FILE, merged_files

logger = logging.getLogger(__name__)

RUN_MEMBERS = (RUN_FILE, MANIFEST_FILE)
_CHUNK = 1 << 20


def zip_members(folder: StorageFolder) -> list[str]:
    """The merged output (trajectories.pkl, or trajectories.json and its chunk files), run.json
    and manifest.json."""
    merged = merged_files(folder)
    members = [*(merged or [MERGED_FILE]), *RUN_MEMBERS]
    missing = [name for name in members if not folder.exists(name)]
    if missing:
        raise GenrunError(
            f"cannot build {ZIP_FILE} in {folder.display()}: {', '.join(missing)} missing (was the run merged?)"
        )
    return members


def write_zip(folder: StorageFolder) -> str:
    """Stream the merged output, run.json and manifest.json into trajectories.zip, a chunk at a
    time (memory stays flat however large the pickles are); works to local disk and S3 alike."""
    members = zip_members(folder)
    with (
        folder.open_write(ZIP_FILE) as raw,
        zipfile.ZipFile(raw, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=1) as archive,
    ):
        for name in members:
            with folder.open_read(name) as source, archive.open(name, "w", force_zip64=True) as target:
                shutil.copyfileobj(source, target, _CHUNK)
    return folder.display(ZIP_FILE)


def publish_run(
    cfg: DictConfig,
    folder: StorageFolder,
    summary: dict[str, Any],
    on_report: Callable[[Report], None] | None = None,
    fence: Fence | None = None,
    *,
    settings: GenerationSettings,
) -> dict[str, Any]:
    """Zip (when merged), write the run report, log metrics (and the report's plots) on every
    configured backend, upload the W&B artifact. `on_report` is handed the report (the flow
    shows its plots as Prefect artifacts). `fence`: the run's lease, checked immediately before
    each step publishes (the zip and the report as their files appear): a run that lost the
    folder publishes nothing more (LeaseLost). `settings`: the run's, as its plan carries them."""
    folder = fenced(folder, fence)
    check = (lambda: fence.check(folder)) if fence is not None else (lambda: None)
    check()
    # The terminal summary (flows/run_command.py) is where a run's figures are read: verl's console
    # backend would print them again as one raw `step:0 - generation/...` line.
    backends = [backend for backend in cfg.trainer.logger if backend != "console"]
    published: dict[str, Any] = {"metrics": throughput_metrics(summary)}
    if "artifact" in summary:
        published["zip"] = write_zip(folder)
    # The run itself loaded its model folder's code when its config said so; the report may too.
    report = _write_report(folder, bool(cfg.actor_rollout_ref.model.trust_remote_code))
    if report is not None:
        published["report"] = report.location
        if report.rewards is not None:
            published["rewards"] = report.rewards
        if on_report is not None:
            on_report(report)
    if not backends:
        return published
    tracking = Tracking(
        project_name=cfg.trainer.project_name,
        experiment_name=cfg.trainer.experiment_name,
        default_backend=backends,
        config=_config_for_tracking(cfg, settings),
    )
    try:
        check()
        tracking.log(data=published["metrics"], step=0)
        if report is not None and "wandb" in backends:
            _log_wandb_plots(report)
        if settings.upload_artifact and "wandb" in backends:
            if "zip" not in published:
                raise GenrunError("generation.upload_artifact needs the merged output: set generation.final_merge=true")
            check()
            published["wandb_artifact"] = _log_wandb_artifact(cfg, folder, summary, settings.artifact_mode)
    finally:
        tracking.finish()
    return published


def _write_report(folder: StorageFolder, trust_remote_code: bool) -> Report | None:
    """report.html in the run folder; None for a run with nothing committed (nothing to show)."""
    try:
        return write_report(folder, trust_remote_code=trust_remote_code)
    except GenrunError as exc:
        logger.warning("no run report: %s", exc)
        return None


def _log_wandb_plots(report: Report) -> None:
    """The report's plots as W&B images (`report/<plot>`), in the run Tracking started."""
    import wandb
    from PIL import Image

    wandb.log(
        {
            f"report/{plot.name}": wandb.Image(Image.open(io.BytesIO(plot.png)), caption=plot.title)
            for plot in report.plots
        },
        step=0,
    )


def _config_for_tracking(cfg: DictConfig, settings: GenerationSettings) -> dict[str, Any]:
    """What decides the output, not verl's whole trainer config (optimizers, critics...)."""
    rollout = cast(dict[str, Any], OmegaConf.to_container(cfg.actor_rollout_ref.rollout, resolve=True))
    keep = (
        "name",
        "temperature",
        "top_p",
        "top_k",
        "n",
        "prompt_length",
        "response_length",
        "calculate_log_probs",
        "max_num_seqs",
    )
    return without_secrets(
        {
            "model": cfg.actor_rollout_ref.model.path,
            "rollout": {key: rollout[key] for key in keep},
            "agent_loop": rollout["agent"]["default_agent_loop"],
            "data": OmegaConf.to_container(cfg.data, resolve=True),
            "generation": dataclasses.asdict(settings),
            "storage_options": OmegaConf.to_container(cfg.storage.options, resolve=True),
            "output": cfg.trainer.default_local_dir,
            # verl's Tracking reads trainer.wandb_proxy from here.
            "trainer": {
                key: cfg.trainer.get(key)
                for key in ("project_name", "experiment_name", "wandb_proxy")
                if key in cfg.trainer
            },
        }
    )


def _log_wandb_artifact(cfg: DictConfig, folder: StorageFolder, summary: dict[str, Any], mode: str) -> str:
    import wandb

    name = f"trajectories-{cfg.trainer.experiment_name}"
    metadata = {
        "fingerprint": summary["fingerprint"],
        "trajectories": summary["num_trajectories"],
        "generated_tokens": summary["generated_tokens"],
        "model": cfg.actor_rollout_ref.model.path,
        "dataset": list(cfg.data.train_files) if not isinstance(cfg.data.train_files, str) else [cfg.data.train_files],
        "output": folder.display(),
        "rollout_n": cfg.actor_rollout_ref.rollout.n,
    }
    artifact = wandb.Artifact(name=name, type="trajectories", metadata=metadata)
    if mode == "reference":
        if folder.is_local:
            raise GenrunError(
                "generation.artifact_mode=reference needs an s3:// output folder; use artifact_mode=upload for local runs"
            )
        # checksum=False: W&B records the URIs without reading the objects (no second copy, no
        # S3 access from W&B); our own checksums are in the run folder.
        for member in (ZIP_FILE, *zip_members(folder)):
            artifact.add_reference(folder.display(member), name=member, checksum=False)
        _log(wandb, artifact)
        return f"{name} (references)"
    with tempfile.TemporaryDirectory() as scratch:
        artifact.add_file(folder.local_copy(ZIP_FILE, os.path.join(scratch, ZIP_FILE)), name=ZIP_FILE)
        _log(wandb, artifact)
    return name


def _log(wandb, artifact) -> None:
    logged = wandb.log_artifact(artifact)
    # Offline runs sync later (`wandb sync`); waiting for a server there would raise.
    if not getattr(wandb.run, "offline", False):
        logged.wait()
