"""genrun's own settings as typed dataclasses, each default written once.

`generation:` and the `engine_kwargs` of genrun's engines (`hf`, `instant`, `remote`) are read
through these classes, not through `cfg.generation.get(key, default)`: a default lives in the
field, and a value derived from others (`max_inflight` from `max_num_seqs`, the request and
sample deadlines from the response budget) is computed by `GenerationSettings.of`, here and
nowhere else. `config/genrun.yaml` stays the reference a user reads; tests/test_settings.py
fails when one of its defaults differs from the field's, or a field has no key there.

Light to import (the standard library only): `genrun status`, `genrun merge` and the shard
workers read run.json's config through it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Self

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


def _section(mapping: Mapping[str, Any] | None, cls: type) -> dict[str, Any]:
    """The keys of `mapping` that are fields of `cls`. A key absent keeps the field's default: a
    run.json written by an older genrun may lack keys added since."""
    names = {f.name for f in fields(cls)}
    return {key: value for key, value in (mapping or {}).items() if key in names}


@dataclass(frozen=True)
class GenerationSettings:
    """The `generation:` section (genrun.yaml explains each key to the user)."""

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
    """Most model calls in flight per shard (None: INFLIGHT_PER_BATCH_SEQUENCE x
    actor_rollout_ref.rollout.max_num_seqs, filled in by `of`); a trajectory in its tool or
    reward function holds none."""
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

    @classmethod
    def of(cls, config: Mapping[str, Any]) -> Self:
        """The settings of a whole run config (a DictConfig, or run.json's plain `config`), the
        derived defaults filled in from the rollout config beside it."""
        settings = cls(**_section(config.get("generation"), cls))
        rollout = (config.get("actor_rollout_ref") or {}).get("rollout") or {}
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
            stall_seconds = default_stall_seconds(request_timeout)
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


def default_stall_seconds(request_timeout: float) -> float:
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


# ---- the engine_kwargs of genrun's own engines -------------------------------------------------

HF_PREFIX_CACHE_BYTES = 512 * 1024 * 1024
"""The transformers engine's prefix cache when engine_kwargs.hf.prefix_cache_bytes is null:
~11k tokens of the bundled 135M model."""


@dataclass(frozen=True)
class HfEngineKwargs:
    """`actor_rollout_ref.rollout.engine_kwargs.hf`: the transformers engine."""

    num_threads: int | None = None
    """Torch threads per replica (None: the node's usable cores shared by its replicas)."""
    ignore_eos: bool = False
    """Benchmarks: every response runs to its length limit."""
    device: str | None = None
    """None: `hf_device` decides (trainer.device); load_config writes its decision here."""
    dtype: str | None = None
    """None: `dtype_on` decides (float32 on the CPU, bfloat16 on a GPU)."""
    prefix_cache_bytes: int | None = None
    """KV kept for prefix reuse (None: HF_PREFIX_CACHE_BYTES; 0: none)."""
    later_turns_first: bool = True
    shared_prefix_attention: bool = True
    weight_first_linear: bool = True

    @classmethod
    def of(cls, engine_kwargs: Mapping[str, Any] | None) -> Self:
        """From the rollout's `engine_kwargs` mapping (its `hf` section may be absent or null)."""
        return cls(**_section((engine_kwargs or {}).get("hf"), cls))

    def dtype_on(self, device: str) -> str:
        # bfloat16 on a GPU (what SGLang/vLLM serve), float32 on the CPU (bf16 matmuls are slow there).
        return self.dtype or ("bfloat16" if device.startswith("cuda") else "float32")

    @property
    def prefix_cache_bytes_or_default(self) -> int:
        return HF_PREFIX_CACHE_BYTES if self.prefix_cache_bytes is None else int(self.prefix_cache_bytes)


def hf_device(configured: str | None, trainer_device: str | None) -> str:
    """The transformers engine's device: engine_kwargs.hf.device, else trainer.device (verl's key
    for it), else cpu. load_config decides it once and writes it into engine_kwargs.hf.device,
    because the replica actor sees only the rollout config (there trainer_device is None)."""
    return configured or trainer_device or "cpu"


def check_hf_device(device: Any) -> str:
    if not isinstance(device, str) or not (device == "cpu" or device.startswith("cuda")):
        raise GenrunError(f"invalid actor_rollout_ref.rollout.engine_kwargs.hf.device={device!r}: use cpu or cuda")
    return device


@dataclass(frozen=True)
class InstantEngineKwargs:
    """`actor_rollout_ref.rollout.engine_kwargs.instant`: the benchmark/test engine."""

    response_tokens: int = 8
    delay_seconds: float = 0.0
    """Seconds each request takes (tests use it to have requests in flight)."""

    @classmethod
    def of(cls, engine_kwargs: Mapping[str, Any] | None) -> Self:
        return cls(**_section((engine_kwargs or {}).get("instant"), cls))


@dataclass(frozen=True)
class RemoteEngineKwargs:
    """`actor_rollout_ref.rollout.engine_kwargs.remote`: OpenAI-compatible servers by URL
    (engines/layout.py `remote_urls` reads and checks base_urls)."""

    base_urls: Sequence[str] | str = field(default_factory=list)
    """The servers' base URLs (a list, or one comma-separated string)."""
    model: str | None = None
    """None: the first model the server lists at /v1/models."""
    api_key: str | None = None
    connect_timeout: float = 10.0
    health_interval: float = 5.0
    """Seconds between /health probes of a server out of rotation."""
    max_connections: int = 256
    """Most connections per server from one shard worker."""

    @classmethod
    def of(cls, engine_kwargs: Mapping[str, Any] | None) -> Self:
        return cls(**_section((engine_kwargs or {}).get("remote"), cls))


ENGINE_KWARGS: dict[str, type] = {
    "hf": HfEngineKwargs,
    "instant": InstantEngineKwargs,
    "remote": RemoteEngineKwargs,
}
"""engine_kwargs.<engine> section -> its settings class (config.CLOSED_SECTIONS: exactly these keys)."""
