"""run.json as a typed record: what a run folder says about the run that took it.

Written once, by the run that takes a new folder (`RunPlan.run_record`, `run_folder.claim_run_folder`);
read by the resume check, `genrun status`, `genrun merge`, the report and `genrun export`
(`run_folder.read_run_record`). Light to import (the standard library only).

Reading is lenient: a run.json written by an earlier genrun may lack keys added since, and each
absent key reads as None (or its documented meaning: no `fingerprint_version` is recipe 1); the
reader that needs one refuses then. Writing is exact: `to_json` keeps the keys and their order
as run.json has always had them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ShardRange:
    """One shard of the run's plan as run.json lists it: `{"name": ..., "range": [start, end]}`."""

    name: str
    start: int
    """First dataset row of the shard."""
    end: int
    """One past its last row."""

    @property
    def rows(self) -> int:
        return self.end - self.start

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "range": [self.start, self.end]}

    @classmethod
    def from_json(cls, payload: dict[str, Any]) -> ShardRange:
        start, end = payload["range"]
        return cls(name=payload["name"], start=int(start), end=int(end))


@dataclass(frozen=True)
class RunRecord:
    """The contents of run.json."""

    fingerprint: str | None
    """The run fingerprint (generation_core/preflight/fingerprint.py): which run the folder holds."""
    fingerprint_version: int = 1
    """The folder format and fingerprint recipe that wrote it (run_folder.FOLDER_FORMAT); absent: 1."""
    versions: dict[str, Any] = field(default_factory=dict)
    """Package versions of the code that produces trajectories (plan.versions)."""
    build: dict[str, Any] | None = None
    """The genrun that took the folder (build.genrun_build; each shard attempt records its own)."""
    pad_token_id: int | None = None
    shards: list[ShardRange] = field(default_factory=list)
    dataset: dict[str, Any] | None = None
    """The input files with their sizes and content hashes (plan.DatasetFiles.to_dict)."""
    rollout_n: int | None = None
    """Samples per prompt (actor_rollout_ref.rollout.n)."""
    created: str | None = None
    """When the run took the folder (UTC, ISO 8601)."""
    config: dict[str, Any] = field(default_factory=dict)
    """The resolved config, secrets masked."""
    settings: dict[str, Any] | None = None
    """The `generation:` settings as the run that took the folder decided them (max_inflight, the
    deadlines filled in: config.generation keeps what the user wrote); None in a run.json written before it was recorded."""

    def to_json(self) -> dict[str, Any]:
        return {
            "fingerprint": self.fingerprint,
            "fingerprint_version": self.fingerprint_version,
            "versions": self.versions,
            "build": self.build,
            "pad_token_id": self.pad_token_id,
            "shards": [shard.to_json() for shard in self.shards],
            "dataset": self.dataset,
            "rollout_n": self.rollout_n,
            "created": self.created,
            "config": self.config,
            "settings": self.settings,
        }

    @classmethod
    def from_json(cls, payload: dict[str, Any]) -> RunRecord:
        return cls(
            fingerprint=payload.get("fingerprint"),
            fingerprint_version=payload.get("fingerprint_version", 1),
            versions=payload.get("versions") or {},
            build=payload.get("build"),
            pad_token_id=payload.get("pad_token_id"),
            shards=[ShardRange.from_json(shard) for shard in payload.get("shards") or []],
            dataset=payload.get("dataset"),
            rollout_n=payload.get("rollout_n"),
            created=payload.get("created"),
            config=payload.get("config") or {},
            settings=payload.get("settings"),
        )

    @property
    def samples_per_prompt(self) -> int:
        """rollout_n, else the config's rollout.n (a run.json written without rollout_n)."""
        if self.rollout_n is not None:
            return int(self.rollout_n)
        return int(((self.config.get("actor_rollout_ref") or {}).get("rollout") or {}).get("n", 1))

    @property
    def rollout(self) -> dict[str, Any]:
        """The config's actor_rollout_ref.rollout section."""
        return self.config["actor_rollout_ref"]["rollout"]
