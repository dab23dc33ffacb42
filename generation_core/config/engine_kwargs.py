"""The settings of genrun's own engines: `actor_rollout_ref.rollout.engine_kwargs.<engine>` for
`hf`, `instant` and `remote`, as typed dataclasses (each key declared once with `checks.key`, each
value checked as the class is built), and the transformers engine's device rule.

Light to import (the standard library only): every engine process reads its kwargs through these.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Self

from generation_core.config.checks import BOOL, integer, key, number, refuse_bad_values, section_of
from generation_core.errors import GenrunError

HF_PREFIX_CACHE_BYTES = 512 * 1024 * 1024
"""The transformers engine's prefix cache when engine_kwargs.hf.prefix_cache_bytes is null:
~11k tokens of the bundled 135M model."""

ENGINE_KWARGS_SECTION = "actor_rollout_ref.rollout.engine_kwargs"


def _null_or_text(what: str):
    return (lambda value: value is None or isinstance(value, str), f"must be null or {what}")


@dataclass(frozen=True)
class HfEngineKwargs:
    """`actor_rollout_ref.rollout.engine_kwargs.hf`: the transformers engine."""

    SECTION: ClassVar[str] = f"{ENGINE_KWARGS_SECTION}.hf"

    num_threads: int | None = key(
        None,
        (integer(1, null=True), "must be null or an integer >= 1"),
        False,
        "torch threads per replica (null: the node's usable cores shared by the replicas on that node)",
    )
    ignore_eos: bool = key(
        False,
        BOOL,
        True,
        "benchmarks: every response runs to `max_response_length` (the `instant` engine is the other benchmark "
        "tool: a fixed short completion at once)",
    )
    device: str | None = key(
        None,
        _null_or_text("cpu or cuda"),
        True,
        "null: `trainer.device` (cpu); `cuda`: each replica holds one GPU of the Ray cluster (load_config writes "
        "the device it decides here)",
    )
    dtype: str | None = key(
        None, _null_or_text("a torch dtype name"), True, "null: float32 on the CPU, bfloat16 on a GPU"
    )
    prefix_cache_bytes: int | None = key(
        None,
        (integer(0, null=True), "must be null (the engine's default) or an integer >= 0 (0: no prefix reuse)"),
        False,
        "KV kept so that a prompt prefills only what earlier ones have not (a trajectory's previous turn, a shared "
        "system prompt, another sample of the same prompt; null: 512 MiB; 0: no reuse)",
    )
    later_turns_first: bool = key(
        True,
        BOOL,
        False,
        "a multi-turn trajectory's next turn joins the decode batch before first turns that wait, so a started "
        "trajectory does not queue behind new ones; false: arrival order",
    )
    weight_first_linear: bool = key(
        True,
        BOOL,
        False,
        "on a CPU, linear layers of 2-128 rows compute `W @ x^T` instead of `x @ W^T`, which MKL runs slowly with "
        "few rows (bench/RESULTS.md); false: transformers' `nn.Linear` (the same tokens up to float rounding)",
    )

    def __post_init__(self) -> None:
        refuse_bad_values(self, self.SECTION)

    @classmethod
    def of(cls, engine_kwargs: Mapping[str, Any] | None) -> Self:
        """From the rollout's `engine_kwargs` mapping (its `hf` section may be absent or null)."""
        return cls(**section_of((engine_kwargs or {}).get("hf"), cls))

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

    SECTION: ClassVar[str] = f"{ENGINE_KWARGS_SECTION}.instant"

    response_tokens: int = key(
        8,
        (integer(0), "must be an integer >= 0"),
        True,
        "`rollout.name=instant` (benchmark/test engine): tokens per completion, derived from the prompt and (when "
        "sampling) temperature, top_p, top_k and the request's seed",
    )
    delay_seconds: float = key(
        0.0,
        (number(above=False), "must be a number of seconds >= 0"),
        False,
        "seconds each request takes (0: instant; tests use it to have requests in flight)",
    )

    def __post_init__(self) -> None:
        refuse_bad_values(self, self.SECTION)

    @classmethod
    def of(cls, engine_kwargs: Mapping[str, Any] | None) -> Self:
        return cls(**section_of((engine_kwargs or {}).get("instant"), cls))


@dataclass(frozen=True)
class RemoteEngineKwargs:
    """`actor_rollout_ref.rollout.engine_kwargs.remote`: OpenAI-compatible servers by URL
    (config/layout.py `remote_urls` reads and checks base_urls)."""

    SECTION: ClassVar[str] = f"{ENGINE_KWARGS_SECTION}.remote"

    base_urls: Sequence[str] | str = key(
        [],
        (lambda value: isinstance(value, str | Sequence), "must be a list of URLs or one comma-separated string"),
        False,
        "`rollout.name=remote`: OpenAI-compatible servers that already run (vLLM, SGLang), e.g. "
        '`["http://10.0.0.5:8000", "http://10.0.0.6:8000"]`; requests go to `/v1/completions` as token ids '
        "([engines.md](engines.md#external-inference-servers-rolloutnameremote))",
    )
    model: str | None = key(
        None, _null_or_text("a model name"), True, "null: the first model the server lists at `/v1/models`"
    )
    api_key: str | None = key(
        None,
        _null_or_text("a key"),
        False,
        "sent as `Authorization: Bearer ...` (`vllm serve --api-key`); never written to run.json",
    )
    connect_timeout: float = key(
        10.0,
        (number(), "must be a number of seconds > 0"),
        False,
        "seconds to connect to a server; a server that does not answer is out of rotation until its `/health` "
        "answers again",
    )
    health_interval: float = key(
        5.0,
        (number(), "must be a number of seconds > 0"),
        False,
        "seconds between `/health` probes of a server out of rotation",
    )
    max_connections: int = key(
        256, (integer(1), "must be an integer >= 1"), False, "most connections per server from one shard worker"
    )

    def __post_init__(self) -> None:
        refuse_bad_values(self, self.SECTION)

    @classmethod
    def of(cls, engine_kwargs: Mapping[str, Any] | None) -> Self:
        return cls(**section_of((engine_kwargs or {}).get("remote"), cls))


ENGINE_KWARGS: dict[str, type] = {
    "hf": HfEngineKwargs,
    "instant": InstantEngineKwargs,
    "remote": RemoteEngineKwargs,
}
"""engine_kwargs.<engine> section -> its settings class (loading.CLOSED_SECTIONS: exactly these keys)."""
