"""The settings of genrun's own engines: `actor_rollout_ref.rollout.engine_kwargs.<engine>` for
`hf`, `instant` and `remote`, as typed dataclasses (each default once, each value checked as the
class is built: checks.py), and the transformers engine's device rule.

Light to import (the standard library only): every engine process reads its kwargs through these.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Self

from generation_core.config.checks import Rule, integer, is_bool, refuse_bad_values, section_of
from generation_core.errors import GenrunError

HF_PREFIX_CACHE_BYTES = 512 * 1024 * 1024
"""The transformers engine's prefix cache when engine_kwargs.hf.prefix_cache_bytes is null:
~11k tokens of the bundled 135M model."""


HF_RULES: dict[str, Rule] = {
    "num_threads": (integer(1, null=True), "must be null or an integer >= 1"),
    "prefix_cache_bytes": (
        integer(0, null=True),
        "must be null (the engine's default) or an integer >= 0 (0: no prefix reuse)",
    ),
    "later_turns_first": (is_bool, "must be true or false"),
    "weight_first_linear": (is_bool, "must be true or false"),
}


@dataclass(frozen=True)
class HfEngineKwargs:
    """`actor_rollout_ref.rollout.engine_kwargs.hf`: the transformers engine (its values checked: HF_RULES)."""

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
    weight_first_linear: bool = True

    def __post_init__(self) -> None:
        refuse_bad_values(self, "actor_rollout_ref.rollout.engine_kwargs.hf", HF_RULES)

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

    response_tokens: int = 8
    delay_seconds: float = 0.0
    """Seconds each request takes (tests use it to have requests in flight)."""

    @classmethod
    def of(cls, engine_kwargs: Mapping[str, Any] | None) -> Self:
        return cls(**section_of((engine_kwargs or {}).get("instant"), cls))


@dataclass(frozen=True)
class RemoteEngineKwargs:
    """`actor_rollout_ref.rollout.engine_kwargs.remote`: OpenAI-compatible servers by URL
    (config/layout.py `remote_urls` reads and checks base_urls)."""

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
        return cls(**section_of((engine_kwargs or {}).get("remote"), cls))


ENGINE_KWARGS: dict[str, type] = {
    "hf": HfEngineKwargs,
    "instant": InstantEngineKwargs,
    "remote": RemoteEngineKwargs,
}
"""engine_kwargs.<engine> section -> its settings class (config.CLOSED_SECTIONS: exactly these keys)."""
