"""genrun's `generation:` settings as a typed dataclass, each default written once, each value checked once.

The `generation:` section is read through `GenerationSettings` and nowhere else (config/ is the
only room that reads `cfg.generation`: tests/test_settings.py holds it; genrun's engines' own kwargs:
engine_kwargs.py). A default lives in the field; a bad value is refused by the class itself
(`__post_init__`, GENERATION_RULES: one line naming the key and what it must be); a value derived
from others (`max_inflight` from `max_num_seqs`, the request and sample deadlines from the
response budget) is computed by `GenerationSettings.of` in every process that reads a config,
never written back into it. `config/genrun.yaml` stays the reference a user reads;
tests/test_settings.py fails when one of its defaults differs from the field's, or a field has no
key there.

Light to import (the standard library only): `genrun status`, `genrun merge` and the shard
workers read run.json's config through it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Self

from generation_core.config.checks import Rule, integer, is_bool, is_number, number, refuse_bad_values, section_of
from generation_core.errors import GenrunError

# The transformers engine on a small CPU model decodes ~3 tokens/s per sequence in a full batch
# and a request may first wait for a batch's worth of others: 2 s per token of the response
# budget plus 10 minutes is ample there and on a GPU, yet finite.
REQUEST_TIMEOUT_BASE_SECONDS = 600.0
REQUEST_TIMEOUT_SECONDS_PER_TOKEN = 2.0

# Model turns the default sample deadline allows when multi_turn has no assistant-turn limit:
# the deadline must be finite, and a run whose samples take more turns sets one.
UNLIMITED_TURNS_ALLOWANCE = 16

# Requests in flight per sequence of the engine's decode batch: the batch stays full while
# finished trajectories are processed and new ones start.
INFLIGHT_PER_BATCH_SEQUENCE = 2

ROUTING_MODES = ("prefix_affinity", "least_loaded", "local")
"""generation.routing's values (serving/replica_loads.py)."""

# The stall alarm's default: a quarter of the request timeout (a request that legitimately takes
# long still leaves the others of a full batch finishing meanwhile), never under two minutes.
STALL_SHARE_OF_REQUEST_TIMEOUT = 0.25
STALL_MIN_SECONDS = 120.0

# Trajectories open per model-call slot: a trajectory in its tool or reward function holds no
# slot, so up to this many per slot may be open for the engine to stay full while tools run (a
# trajectory that spends 7/8 of its time in tools still leaves none idle).
OPEN_TRAJECTORIES_PER_CALL_SLOT = 8


GENERATION_RULES: dict[str, Rule] = {
    "num_shards": (integer(1), "must be an integer >= 1"),
    "part_target_bytes": (integer(1), "must be an integer >= 1"),
    "max_inflight": (
        integer(1, null=True),
        "must be null (twice actor_rollout_ref.rollout.max_num_seqs) or an integer >= 1",
    ),
    "max_open_trajectories": (integer(1, null=True), "must be null (8 x generation.max_inflight) or an integer >= 1"),
    "inflight_share_cap": (integer(1), "must be an integer >= 1 (1: each shard keeps its own max_inflight)"),
    "retries": (integer(0), "must be an integer >= 0"),
    "retry_delay_seconds": (number(above=False), "must be a number of seconds >= 0"),
    "lease_seconds": (number(4, above=False), "must be a number of seconds >= 4"),
    "request_retries": (integer(0), "must be an integer >= 0"),
    "request_backoff_seconds": (number(above=False), "must be a number of seconds >= 0"),
    "request_timeout": (
        number(null=True),
        "must be null (derived from the response budget) or a number of seconds > 0",
    ),
    "sample_timeout_seconds": (
        number(null=True),
        "must be null (derived from turns, request_retries and request_timeout) or a number of seconds > 0",
    ),
    "max_failed_fraction": (lambda v: is_number(v) and 0 <= v <= 1, "must be a fraction between 0 and 1"),
    "gpu_hour_price": (
        number(above=False, null=True),
        "must be null (no cost figures) or the price of one GPU-hour, a number >= 0 (e.g. 2.5)",
    ),
    "recheck_finished_rows": (is_bool, "must be true or false"),
    "reward_workers": (integer(1), "must be an integer >= 1"),
    "merge_chunk_size": (
        integer(1, null=True),
        "must be null (one trajectories.pkl) or an integer >= 1 (trajectories per chunk file)",
    ),
    "merge_max_file_bytes": (
        integer(1 << 20),
        "must be an integer number of bytes >= 1048576 (e.g. 4294967296 for 4 GiB)",
    ),
    "sample_seed": (integer(0, null=True), "must be null (no per-sample seeds) or an integer >= 0"),
    "routing": (lambda v: v in ROUTING_MODES, f"must be one of {', '.join(ROUTING_MODES)}"),
    "save_batch_size": (
        integer(1, null=True),
        "must be null (parts cut by size and age only) or an integer >= 1 (most trajectories per part)",
    ),
    "part_max_seconds": (number(), "must be a number of seconds > 0"),
    "first_part_max_seconds": (number(null=True), "must be null or a number of seconds > 0"),
    "pull_timeout": (number(), "must be a number of seconds > 0"),
    "progress_seconds": (number(), "must be a number of seconds > 0"),
    "stall_seconds": (
        number(null=True),
        "must be null (a quarter of generation.request_timeout) or a number of seconds > 0",
    ),
    "artifact_mode": (lambda v: v in ("upload", "reference"), "must be upload or reference"),
}
"""The checks of GenerationSettings, in the order a config's values are refused."""


@dataclass(frozen=True)
class GenerationSettings:
    """The `generation:` section (genrun.yaml explains each key to the user). Building one checks
    every value (GENERATION_RULES); `of` also checks the values that depend on the rollout."""

    part_target_bytes: int = 64 << 20
    """A part is committed once it holds this many bytes (parts are few and large)."""
    part_max_seconds: float = 60.0
    """...or once its first trajectory is this old: the work a crash can lose."""
    first_part_max_seconds: float | None = 5.0
    """The age limit of each shard attempt's first part (None: part_max_seconds)."""
    save_batch_size: int | None = None
    """Most trajectories per part (None: parts cut by size and age only)."""
    pull_timeout: float = 30.0
    """Longest wait for a finished trajectory before a shard looks at its open part again."""
    num_shards: int = 1
    """Fixed index ranges of the dataset; output-shaping (in the fingerprint)."""
    max_inflight: int | None = None
    """A shard's model-call slots: its model calls in flight (None: INFLIGHT_PER_BATCH_SEQUENCE x
    actor_rollout_ref.rollout.max_num_seqs, filled in by `of`); a trajectory in its tool or
    reward function holds none. Open trajectories have their own setting (max_open_trajectories),
    the failure slack its own name (systematic_failure_margin)."""
    max_open_trajectories: int | None = None
    """Most trajectories open per shard, in a model call or not (None:
    OPEN_TRAJECTORIES_PER_CALL_SLOT x max_inflight, filled in by `of`)."""
    inflight_share_cap: int = 8
    """A shard still running while others finished may take up to this many times max_inflight
    (shard/progress_board.py: the run's in-flight budget shared by the shards still running)."""
    sample_seed: int | None = None
    """Base of every request's seed (None: engines sample freely)."""
    adaptive: bool = False
    """Sample each prompt in two rounds (shard/adaptive.py): its first adaptive_k samples, then
    the other n - adaptive_k only when those neither all pass nor all fail."""
    adaptive_k: int = 4
    """Samples of a prompt's first round; output-shaping."""
    adaptive_pass_threshold: float = 0.0
    """A sample passes when its reward is above this; output-shaping."""
    recheck_finished_rows: bool = True
    """On a resume, read each finished shard's rows again and compare them with their digest."""
    retries: int = 2
    """Prefect task retries of a failed shard."""
    retry_delay_seconds: float = 5.0
    lease_seconds: float = 60.0
    """One run per output folder: the lease is renewed every lease_seconds / 4."""
    request_retries: int = 3
    """Retries of one engine request after a transient error."""
    request_backoff_seconds: float = 1.0
    request_timeout: float | None = None
    """Seconds one request attempt may take (None: `default_request_timeout`, filled in by `of`)."""
    sample_timeout_seconds: float | None = None
    """Longest one sample may take, start to score (None: `default_sample_timeout`, filled in by `of`)."""
    max_failed_fraction: float = 0.0
    """A shard fails once more than this fraction of its trajectories failed."""
    reward_workers: int = 4
    """Threads scoring the custom reward function, off the event loop."""
    final_merge: bool = True
    merge_chunk_size: int | None = None
    """Trajectories per merged chunk file (None: one trajectories.pkl up to merge_max_file_bytes)."""
    merge_max_file_bytes: int = 4 << 30
    """Without a chunk size, the merge keeps one file (and the DataProto held to write it) under
    this: a run past it is merged into chunks of about this size, so a 10M-trajectory run never
    builds one pickle in memory, while runs up to tens of thousands of trajectories at verl's
    usual lengths stay one trajectories.pkl."""
    stall_seconds: float | None = None
    """No committed trajectory and no generated token for this long: the stall alarm (None:
    `default_stall_seconds` of the request timeout, filled in by `of`)."""
    show_progress: bool = True
    progress_seconds: float = 30.0
    gpu_hour_price: float | None = None
    """Price of one GPU-hour (None: the capacity ledger gives no cost figures)."""
    upload_artifact: bool = False
    artifact_mode: str = "upload"
    """upload: the zip itself to W&B; reference: its s3:// objects."""
    routing: str = "prefix_affinity"
    """How a shard worker picks a replica per request (serving/replica_loads.py; ROUTING_MODES):
    prefix_affinity (global load, the n samples of a prompt together), least_loaded (global
    load), local (this worker's own requests outstanding)."""

    def __post_init__(self) -> None:
        refuse_bad_values(self, "generation", GENERATION_RULES)

    @classmethod
    def of(cls, config: Mapping[str, Any]) -> Self:
        """The settings of a whole run config (a DictConfig, or run.json's plain `config`), the
        derived defaults filled in from the rollout config beside it."""
        settings = cls(**section_of(config.get("generation"), cls))
        rollout = (config.get("actor_rollout_ref") or {}).get("rollout") or {}
        n = rollout.get("n")
        if settings.adaptive and n is not None and not (integer(1)(settings.adaptive_k) and settings.adaptive_k < n):
            raise GenrunError(
                f"invalid generation.adaptive_k={settings.adaptive_k!r}: must be an integer from 1 to "
                f"actor_rollout_ref.rollout.n - 1 (n={n}) with generation.adaptive=true"
            )
        return settings.with_derived_defaults(rollout)

    def with_derived_defaults(self, rollout: Mapping[str, Any]) -> Self:
        """Every setting left None that another one decides, decided (`rollout`: the
        actor_rollout_ref.rollout section)."""
        max_inflight = self.max_inflight
        if max_inflight is None and rollout.get("max_num_seqs") is not None:
            max_inflight = INFLIGHT_PER_BATCH_SEQUENCE * int(rollout["max_num_seqs"])
        max_open = self.max_open_trajectories
        if max_open is None and max_inflight is not None:
            max_open = OPEN_TRAJECTORIES_PER_CALL_SLOT * max_inflight
        request_timeout = self.request_timeout
        if request_timeout is None and rollout.get("response_length") is not None:
            request_timeout = default_request_timeout(int(rollout["response_length"]))
        sample_timeout = self.sample_timeout_seconds
        if sample_timeout is None and request_timeout is not None:
            sample_timeout = default_sample_timeout(model_turns(rollout), self.request_retries, request_timeout)
        stall_seconds = self.stall_seconds
        if stall_seconds is None and request_timeout is not None:
            stall_seconds = default_stallnumber(request_timeout)
        return dataclasses.replace(
            self,
            max_inflight=max_inflight,
            max_open_trajectories=max_open,
            request_timeout=request_timeout,
            sample_timeout_seconds=sample_timeout,
            stall_seconds=stall_seconds,
        )

    @property
    def inflight_limit(self) -> int:
        """max_inflight, decided (`of` fills it in from max_num_seqs)."""
        if self.max_inflight is None:
            raise ValueError(
                "generation.max_inflight is undecided: build the settings with GenerationSettings.of(config)"
            )
        return self.max_inflight

    @property
    def open_trajectories_limit(self) -> int:
        """max_open_trajectories, decided, and never under max_inflight."""
        if self.max_open_trajectories is None:
            return OPEN_TRAJECTORIES_PER_CALL_SLOT * self.inflight_limit
        return max(self.max_open_trajectories, self.inflight_limit)

    @property
    def systematic_failure_margin(self) -> int:
        """Failures past max_failed_fraction's allowance after which a shard stops early (having
        committed what succeeded) instead of failing every remaining sample slowly. Twice the
        samples in flight: more than a passing fault (a replica restarting under the requests
        in flight) can fail, so only something systematic (engine down, broken loop) gets there."""
        return 2 * self.inflight_limit


def default_request_timeout(response_length: int) -> float:
    """generation.request_timeout when left null: base + per-token allowance x response budget."""
    return REQUEST_TIMEOUT_BASE_SECONDS + REQUEST_TIMEOUT_SECONDS_PER_TOKEN * response_length


def default_stallnumber(request_timeout: float) -> float:
    """generation.stall_seconds when left null: a share of the request timeout, at least STALL_MIN_SECONDS."""
    return max(STALL_MIN_SECONDS, STALL_SHARE_OF_REQUEST_TIMEOUT * float(request_timeout))


def model_turns(rollout: Mapping[str, Any]) -> int:
    """Model turns one sample may take: multi_turn.max_assistant_turns (UNLIMITED_TURNS_ALLOWANCE
    when it sets none), 1 without multi_turn."""
    multi_turn = rollout.get("multi_turn") or {}
    if not multi_turn.get("enable"):
        return 1
    return int(multi_turn.get("max_assistant_turns") or UNLIMITED_TURNS_ALLOWANCE)


def default_sample_timeout(turns: int, request_retries: int, request_timeout: float) -> float:
    """generation.sample_timeout_seconds when left null: every model turn may use all of its
    request attempts (request_retries + 1, each up to request_timeout) and one request_timeout
    more for its tool calls (the last one's for the reward function). The deadline is there for
    code nothing else bounds (a tool or reward function that never returns), never to cut a
    sample short that the request retries would have carried through."""
    return float(turns * (request_retries + 2) * request_timeout)
