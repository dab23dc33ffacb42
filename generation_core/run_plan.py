"""The run's vocabulary: what a run is (`RunPlan`), its shards (`ShardSpec`), its input files
(`DataFile`, `DatasetFiles`) and the versions that shape its output (`versions`).

Plain data, light to import: the read-only commands (`genrun status`, `report`, `export`) and
every module that only passes a plan along import this one, not preflight/ (which checks inputs
with verl's tokenizer, Hydra and the engines) or inputs/ (pyarrow, verl's dataset code), so they
load no torch, verl or Ray. Its third-party imports are omegaconf (the plan's config is a
DictConfig) and, through store/folder.py, fsspec.

A plan crosses process boundaries whole, as one JSON text: `RunPlan.to_json` / `from_json`
(secrets masked on the way out, put back from the environment on the way in:
generation_core.secrets). The CLI hands that text to the flow, the flow hands the same text to
every Prefect task (run_shard, merge, publish), and each parses it once.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import InitVar, asdict, dataclass, field
from importlib import metadata
from typing import Any, cast

from omegaconf import DictConfig, OmegaConf

from generation_core.build import genrun_build
from generation_core.config.settings import GenerationSettings
from generation_core.errors import GenrunError
from generation_core.secrets import SECRETS_ENV, from_environment, masked_paths, split_secrets, with_secrets
from generation_core.store.folder import StorageFolder
from generation_core.store.run_folder import FOLDER_FORMAT, claim_run_folder, config_without_secrets, shard_name
from generation_core.store.run_record import RunRecord, ShardRange


def versions() -> dict[str, str]:
    names = ("genrun", "verl", "transformers", "torch")
    found = {}
    for name in names:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "unknown"
    return found


@dataclass(frozen=True)
class DataFile:
    """One input file: its URL (as fsspec opens it), its row count and, to tell that it is still
    the file the run was planned from (`check_planned`), its size and `planned_digest`."""

    url: str
    rows: int
    size: int | None = None
    """Bytes, at planning (None: a plan written before genrun recorded it)."""
    digest: str | None = None
    """sha256 of the Parquet footer (row groups, offsets, statistics) or of a JSON file whole."""
    first_row: int = 0
    """The dataset row of the file's first row (the rows of the files before it): an OpenAI batch
    file's requests take their `extra_info.index` from here on (inputs/openai_batch.py)."""

    @property
    def is_parquet(self) -> bool:
        return self.url.endswith(".parquet")


@dataclass(frozen=True)
class DatasetFiles:
    """The run's input: files in order, and the rows the run uses (`data.train_max_samples` caps
    the total; rows are numbered across the files in order). Plain data: crosses to shard jobs."""

    files: tuple[DataFile, ...]
    num_rows: int

    def to_dict(self) -> dict[str, Any]:
        files = [
            {"url": f.url, "rows": f.rows, "size": f.size, "digest": f.digest, "first_row": f.first_row}
            for f in self.files
        ]
        return {"files": files, "num_rows": self.num_rows}

    @classmethod
    def from_dict(cls, payload: dict[str, Any]) -> DatasetFiles:
        return cls(
            tuple(
                DataFile(str(f["url"]), int(f["rows"]), f.get("size"), f.get("digest"), int(f.get("first_row", 0)))
                for f in payload["files"]
            ),
            int(payload["num_rows"]),
        )

    def pieces(self, start: int, end: int) -> Iterator[tuple[DataFile, int, int]]:
        """(file, first row, end row) in file-local numbers for every file overlapping the
        dataset rows [start, end)."""
        end = min(end, self.num_rows)
        offset = 0
        for data_file in self.files:
            if offset >= end:
                break
            lo, hi = max(start, offset), min(end, offset + data_file.rows)
            if lo < hi:
                yield data_file, lo - offset, hi - offset
            offset += data_file.rows


@dataclass(frozen=True)
class ShardSpec:
    """A fixed range of raw dataset rows [start, end) and its stable name."""

    shard_id: int
    start: int
    end: int

    @property
    def name(self) -> str:
        return shard_name(self.shard_id)

    def __len__(self) -> int:
        return self.end - self.start

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, payload: dict[str, int]) -> ShardSpec:
        return cls(int(payload["shard_id"]), int(payload["start"]), int(payload["end"]))


def plan_shards(num_rows: int, num_shards: int) -> list[ShardSpec]:
    """Split rows 0..num_rows into `num_shards` contiguous, nearly equal ranges."""
    if num_shards > num_rows:
        raise GenrunError(
            f"generation.num_shards={num_shards} is more than the {num_rows} prompts; use at most {num_rows}"
        )
    base, extra = divmod(num_rows, num_shards)
    shards, start = [], 0
    for shard_id in range(num_shards):
        end = start + base + (1 if shard_id < extra else 0)
        shards.append(ShardSpec(shard_id, start, end))
        start = end
    return shards


@dataclass
class RunPlan:
    """What a run is: its resolved config, fingerprint, input files and shards. Serializable."""

    cfg: DictConfig
    fingerprint: str
    shards: list[ShardSpec]
    """By id."""
    pad_token_id: int
    dataset: DatasetFiles = field(default_factory=lambda: DatasetFiles((), 0))
    """The input files and their row counts; shards are ranges of these rows."""
    model_digest: str | None = None
    """The model's identity as the fingerprint took it (preflight.fingerprint.model_identity, or the
    model a remote server serves); every trajectory's provenance names it."""
    folder: StorageFolder = field(init=False, repr=False, compare=False)
    settings: GenerationSettings = field(init=False, repr=False, compare=False)
    """The run's `generation:` settings, decided once on the driver (GenerationSettings.of: max_inflight
    and the deadlines filled in) and carried in the plan's JSON; every shard job, worker, scorer,
    router and the publish step takes them from here."""
    decided: InitVar[GenerationSettings | None] = None
    """The settings as the driver decided them (from_json); None: decided here, from cfg."""

    def __post_init__(self, decided: GenerationSettings | None) -> None:
        self.folder = StorageFolder(
            self.cfg.trainer.default_local_dir, cast(dict[str, Any], OmegaConf.to_container(self.cfg.storage.options))
        )
        self.settings = decided if decided is not None else GenerationSettings.of(self.cfg)

    def to_json(self) -> str:
        """The whole plan as JSON text, secrets masked: the one shape every Prefect task takes (a
        string, which Prefect does not walk looking for futures as it walks a dict parameter)."""
        return json.dumps(
            {
                "config": split_secrets(OmegaConf.to_container(self.cfg, resolve=True))[0],
                "fingerprint": self.fingerprint,
                "shards": [shard.to_dict() for shard in self.shards],
                "pad_token_id": self.pad_token_id,
                "dataset": self.dataset.to_dict(),
                "model_digest": self.model_digest,
                "settings": asdict(self.settings),
            }
        )

    @classmethod
    def from_json(cls, text: str) -> RunPlan:
        """The secrets to_json masked come back from this process's environment (the driver's
        own, or the runtime env Ray gives the run's workers: generation_core.secrets); a
        placeholder left in their place would be sent as the secret, so it is refused."""
        payload = json.loads(text)
        config = with_secrets(payload["config"], from_environment())
        missing = masked_paths(config)
        if missing:
            raise GenrunError(
                f"this process was not given the run's secrets ({', '.join(missing)}): {SECRETS_ENV} is missing from "
                "its environment. Ray workers get it from the driver's runtime env; set it in the environment of the "
                "cluster's workers, or set those keys from the environment in the overrides (key='${oc.env:NAME}')"
            )
        return cls(
            cfg=OmegaConf.create(config),
            fingerprint=payload["fingerprint"],
            shards=[ShardSpec.from_dict(shard) for shard in payload["shards"]],
            pad_token_id=int(payload["pad_token_id"]),
            dataset=DatasetFiles.from_dict(payload["dataset"]),
            model_digest=payload.get("model_digest"),
            decided=GenerationSettings(**payload["settings"]),
        )

    def run_record(self) -> RunRecord:
        """What run.json holds: written once, by the run that takes a new folder."""
        return RunRecord(
            fingerprint=self.fingerprint,
            # Which recipe computed it: a later genrun tells this folder's owner what changed.
            fingerprint_version=FOLDER_FORMAT,
            versions=versions(),
            # The genrun that took the folder (build.py: each shard's attempt records its own too).
            build=genrun_build(),
            pad_token_id=self.pad_token_id,
            shards=[ShardRange(s.name, s.start, s.end) for s in sorted(self.shards, key=lambda s: s.shard_id)],
            dataset=self.dataset.to_dict(),
            rollout_n=self.cfg.actor_rollout_ref.rollout.n,
            created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            settings=asdict(self.settings),
            # storage.options can hold credentials: never written.
            config=config_without_secrets(cast(dict[str, Any], OmegaConf.to_container(self.cfg, resolve=True))),
        )

    def claim_folder(self) -> None:
        """Write run.json for a new run, or confirm the folder is this run's (the caller holds the lease)."""
        claim_run_folder(self.folder, self.run_record())
