"""genrun's `generation:` settings as a typed dataclass, each key declared once, each value checked once.

The `generation:` section is read through `GenerationSettings` and nowhere else (config/ is the
only room that reads `cfg.generation`: tests/test_settings.py holds it; genrun's engines' own kwargs:
engine_kwargs.py). Each key is one field made by `checks.key`: its default, its rule (a bad value
is refused by the class itself, in one line naming the key and what it must be), whether it
shapes output, and its line of doc. DECLARED lists the sections declared that way; load_config
merges their defaults into the config (genrun.yaml does not repeat them), the fingerprint leaves
out the keys that do not shape output, and docs/configuration.md's tables are `checks.key_table`'s
(tests/test_docs.py). A value derived from others (`max_inflight` from `max_num_seqs`, the
request and sample deadlines from the response budget) is computed by `GenerationSettings.of` on
the driver, once per plan (run_plan.RunPlan.settings), and handed down, never written back into
the config.

Light to import (the standard library only): `genrun status`, `genrun merge` and the shard
workers read run.json's config through it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Self

from generation_core.config.checks import (
    BOOL,
    defaults_of,
    integer,
    is_number,
    key,
    number,
    one_of,
    refuse_bad_values,
    section_of,
)
from generation_core.config.engine_kwargs import ENGINE_KWARGS, ENGINE_KWARGS_SECTION
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


@dataclass(frozen=True)
class GenerationSettings:
    """The `generation:` section, each key declared once (`key`: default, rule, whether it shapes
    output, its line in docs/configuration.md). Building one checks every value; `of` also checks
    the values that depend on the rollout and decides the derived defaults."""

    SECTION: ClassVar[str] = "generation"

    num_shards: int = key(
        1,
        (integer(1), "must be an integer >= 1"),
        True,
        "fixed index ranges of the dataset, the unit of resume (changing it on an existing run folder is refused: "
        "the fingerprint changes)",
    )
    part_target_bytes: int = key(
        64 << 20,
        (integer(1), "must be an integer >= 1"),
        False,
        "a part (an immutable Parquet file; parts are few and large) is committed once it holds this many bytes",
    )
    part_max_seconds: float = key(
        60.0,
        (number(), "must be a number of seconds > 0"),
        False,
        "...or once its first trajectory is this many seconds old: the work a crash can lose",
    )
    first_part_max_seconds: float | None = key(
        5.0,
        (number(null=True), "must be null or a number of seconds > 0"),
        False,
        "the age limit of each shard attempt's first part (null: `part_max_seconds`), so a run shows committed "
        "output early",
    )
    save_batch_size: int | None = key(
        None,
        (
            integer(1, null=True),
            "must be null (parts cut by size and age only) or an integer >= 1 (most trajectories per part)",
        ),
        False,
        "most trajectories per part (null: parts cut by size and age only)",
    )
    pull_timeout: float = key(
        30.0,
        (number(), "must be a number of seconds > 0"),
        False,
        "longest wait for a finished trajectory before a shard looks at its open part again",
    )
    routing: str = key(
        "prefix_affinity",
        one_of(*ROUTING_MODES),
        False,
        "how each shard worker picks a replica for a request: `prefix_affinity` (the least-loaded replica by the "
        "load all shard workers share, each replica's own count sent back with its answers; the n samples of a "
        "prompt and every turn of a trajectory on one replica, so its prefix cache prefills the prompt once), "
        "`least_loaded` (the shared load alone), `local` (the fewest requests outstanding from this shard worker)",
    )
    max_inflight: int | None = key(
        None,
        (integer(1, null=True), "must be null (twice actor_rollout_ref.rollout.max_num_seqs) or an integer >= 1"),
        False,
        "a shard's model-call slots: the model calls it has in flight; a trajectory in its tool call or reward "
        "function holds none, and a freed slot goes to a started trajectory's next turn before a new prompt "
        "(null: twice `actor_rollout_ref.rollout.max_num_seqs`, 128 for the defaults, decided once on the driver "
        "and recorded in run.json). The failure slack of `max_failed_fraction` is twice it",
    )
    max_open_trajectories: int | None = key(
        None,
        (integer(1, null=True), "must be null (8 x generation.max_inflight) or an integer >= 1"),
        False,
        "most trajectories open per shard, in a model call or not (tools, reward, between turns); new ones start "
        "while a model-call slot would otherwise go unused (null: 8 x `max_inflight`; set it to `max_inflight` "
        "for one slot per trajectory from start to finish)",
    )
    inflight_share_cap: int = key(
        8,
        (integer(1), "must be an integer >= 1 (1: each shard keeps its own max_inflight)"),
        False,
        "idle capacity goes to the stragglers: the run's in-flight budget is `max_inflight` x the most shard jobs "
        "generating at once, and as shards finish the ones still running share it, each up to this many times its "
        "own `max_inflight` and `max_open_trajectories` (1: every shard keeps its own)",
    )
    sample_seed: int | None = key(
        None,
        (integer(0, null=True), "must be null (no per-sample seeds) or an integer >= 0"),
        True,
        "null: engines sample freely. An integer: each sample's requests carry a seed from (this value, index, "
        "rollout n): sampled runs are reproducible and resume to the same tokens on `hf`, `instant` and vLLM "
        "(`remote`); the hf engine then draws those rows one at a time",
    )
    adaptive: bool = key(
        False,
        BOOL,
        True,
        "adaptive sampling: each prompt's first `adaptive_k` samples, then the other `n - adaptive_k` only when some "
        "of those pass and some do not; decided from commit records only, so a shard killed, stopped or retried "
        "draws exactly what an uninterrupted one does; the success marker counts the samples not drawn "
        "(`not_owed`). Needs a reward function ([agents.md](agents.md))",
    )
    adaptive_k: int = key(
        4,
        (integer(1), "must be an integer >= 1"),
        True,
        "samples of a prompt's first round (1 to `actor_rollout_ref.rollout.n` - 1)",
    )
    adaptive_pass_threshold: float = key(
        0.0, (is_number, "must be a number"), True, "a sample passes when its reward is above this"
    )
    reward_workers: int = key(
        4,
        (integer(1), "must be an integer >= 1"),
        False,
        "threads computing the custom reward function, off the event loop so scoring never stalls generation",
    )
    request_retries: int = key(
        3,
        (integer(0), "must be an integer >= 0"),
        False,
        "retries of a transient error of one engine request (connection, timeout, replica died, HTTP 5xx/429, "
        "engine failure; never a rejected request or a programming error)",
    )
    request_backoff_seconds: float = key(
        1.0,
        (number(above=False), "must be a number of seconds >= 0"),
        False,
        "the first retry's wait; it doubles with each retry",
    )
    request_timeout: float | None = key(
        None,
        (number(null=True), "must be null (derived from the response budget) or a number of seconds > 0"),
        False,
        "seconds one request attempt may take; null: 600 + 2 x `actor_rollout_ref.rollout.response_length` (856 s "
        "for the defaults). Set a number for engines slower than ~0.5 tokens/s per sequence",
    )
    sample_timeout_seconds: float | None = key(
        None,
        (
            number(null=True),
            "must be null (derived from turns, request_retries and request_timeout) or a number of seconds > 0",
        ),
        False,
        "longest one sample may take, start to score; a sample past it is cancelled, frees its slot and is recorded "
        "as a failed sample. null: turns x (`request_retries` + 2) x `request_timeout`, turns being "
        "`multi_turn.max_assistant_turns` (1 without multi_turn, 16 with no limit; 4280 s for the defaults) "
        "([agents.md](agents.md))",
    )
    stall_seconds: float | None = key(
        None,
        (number(null=True), "must be null (a quarter of generation.request_timeout) or a number of seconds > 0"),
        False,
        "the stall alarm: no trajectory committed and no token generated for this many seconds gives a warning "
        'line in the terminal and a Prefect log entry and markdown artifact; `genrun status` says "stalled since '
        '...". null: a quarter of `request_timeout`, at least 120 s (214 s for the defaults)',
    )
    max_failed_fraction: float = key(
        0.0,
        (lambda v: is_number(v) and 0 <= v <= 1, "must be a fraction between 0 and 1"),
        False,
        "a shard fails (and a retry or rerun regenerates the failed samples) once more than this fraction of its "
        "trajectories failed; 0.0: every failure fails the shard after it has generated everything else. A shard "
        "whose failures pass that allowance by twice `max_inflight` stops early, with what succeeded committed",
    )
    recheck_finished_rows: bool = key(
        True,
        BOOL,
        False,
        "true: when a run resumes, each finished shard's rows are read again (no tokenizing) and checked against "
        "the digest its first attempt recorded; false: skip the read ([reliability.md](reliability.md#resume))",
    )
    retries: int = key(
        2,
        (integer(0), "must be an integer >= 0"),
        False,
        "Prefect task retries of a failed shard, each resuming from the shard's checkpoint. A shard refused because "
        "its input changed under the run is not retried: the run stops with that one line, exit 2",
    )
    retry_delay_seconds: float = key(
        5.0,
        (number(above=False), "must be a number of seconds >= 0"),
        False,
        "seconds before a failed shard's retry starts (the driver keeps watching the others meanwhile)",
    )
    lease_seconds: float = key(
        60.0,
        (number(4, above=False), "must be a number of seconds >= 4"),
        False,
        "one run at a time per output folder: the run's lease is renewed every `lease_seconds / 4`; a killed "
        "run's lease blocks the folder until it is this old (at once when it ran on this host and its process is "
        "gone)",
    )
    final_merge: bool = key(True, BOOL, False, "build `trajectories.pkl` at the end")
    merge_chunk_size: int | None = key(
        None,
        (
            integer(1, null=True),
            "must be null (one trajectories.pkl) or an integer >= 1 (trajectories per chunk file)",
        ),
        False,
        "null: one `trajectories.pkl`, unless the padded DataProto would pass `merge_max_file_bytes`. N: "
        "`trajectories-00000.pkl`, ... of at most N trajectories each ((index, rollout n) order, padded "
        "identically: `DataProto.concat` of them is the whole run) plus `trajectories.json` listing chunk names, "
        "rows, bytes and sha256; the merge then holds one chunk in memory. Changing it and merging again replaces "
        "the previous output",
    )
    merge_max_file_bytes: int = key(
        4 << 30,
        (integer(1 << 20), "must be an integer number of bytes >= 1048576 (e.g. 4294967296 for 4 GiB)"),
        False,
        "without a chunk size, a run whose padded DataProto would pass this (4 GiB: about 35k trajectories at "
        "1k+2k tokens) is merged into chunks of about this size, so the merge never holds more in memory",
    )
    show_progress: bool = key(
        True,
        BOOL,
        False,
        "one progress display for the whole run (trajectories done / total, rate, ETA, failures, shards done): a "
        "live line in a terminal, a plain log line every `progress_seconds` otherwise; false: none",
    )
    progress_seconds: float = key(
        30.0, (number(), "must be a number of seconds > 0"), False, "seconds between plain progress lines"
    )
    gpu_hour_price: float | None = key(
        None,
        (
            number(above=False, null=True),
            "must be null (no cost figures) or the price of one GPU-hour, a number >= 0 (e.g. 2.5)",
        ),
        False,
        "null: no cost figures. The price of one GPU-hour (any currency): the capacity ledger (manifest.json's "
        "`ledger`, the terminal summary, `genrun status`, the report) gives the run's cost in total and per 1M "
        "output tokens from its GPU-seconds (a CPU replica counts as one GPU)",
    )
    upload_artifact: bool = key(
        False,
        BOOL,
        False,
        "with `wandb` in `trainer.logger`: upload `trajectories.zip` as a W&B artifact of type `trajectories` "
        "([outputs.md](outputs.md#publishing-zip-metrics-weights--biases))",
    )
    artifact_mode: str = key(
        "upload",
        one_of("upload", "reference"),
        False,
        "`upload` (the zip itself) or `reference` (record the s3:// objects instead, no second copy)",
    )

    def __post_init__(self) -> None:
        refuse_bad_values(self, self.SECTION)

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


DECLARED: dict[str, type] = {
    GenerationSettings.SECTION: GenerationSettings,
    **{f"{ENGINE_KWARGS_SECTION}.{engine}": cls for engine, cls in ENGINE_KWARGS.items()},
}
"""Every section whose keys are declared one by one (`checks.key`), by its place in the config."""


def declared_defaults() -> dict[str, Any]:
    """Every declared section's defaults as one nested mapping, for load_config to merge over
    verl's config and genrun.yaml."""
    merged: dict[str, Any] = {}
    for section, cls in DECLARED.items():
        node = merged
        *parents, leaf = section.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = defaults_of(cls)
    return merged
