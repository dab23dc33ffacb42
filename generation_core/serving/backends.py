"""The backends a routing client sends requests to (routing.py), and the one for Ray replicas.

A backend is one inference server as the routing client sees it (`Backend`): `generate` with
verl's engine contract, the exceptions that mean the server failed (`server_failures`, which take
it out of rotation) and a `probe` that says when it serves again. A `BackendSource` finds a run's
backends. Two kinds exist: `RayReplicaBackend`, the server actor of a booted verl replica (`hf`,
`instant`, `sglang`, `vllm`), and engines/remote.py's `CompletionsServer` (`rollout.name=remote`).

What verl's LLMServerClient adds to a replica call (a fresh request id per turn, multimodal and
priority arguments) lives in `RayReplicaBackend.generate`; what it adds to every output stays in
the routing client, for every backend.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

from omegaconf import DictConfig
from ray.exceptions import ActorUnavailableError, RayActorError
from verl.workers.rollout.replica import TokenOutput

from generation_core.engines.request_batching import BATCH_METHOD, LoadReport, RequestBatcher

if TYPE_CHECKING:
    from generation_core.engines.base import EngineOutput


class ServerGone(Exception):
    """A backend's probe: the server will never serve again (e.g. its actor is out of restarts)."""


class Backend(Protocol):
    """One inference server as the routing client sees it."""

    server_failures: tuple[type[BaseException], ...]
    """What `generate` raises when the server failed (it leaves the rotation); anything else is
    the request's own failure (the server stays)."""
    probe_interval: float
    """Seconds between two probes of a server out of rotation."""

    async def generate(
        self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any], **kwargs: Any
    ) -> TokenOutput | EngineOutput:
        """The engine contract (engines/base.py); `as_token_output` makes either a TokenOutput."""
        ...

    async def probe(self) -> bool:
        """Whether the server serves again: True (back in rotation), False (ask again later);
        raises ServerGone when it never will."""
        ...

    # Optional, for the shared load (replica_loads.py): `watch_load(report)`, after which the
    # backend calls report(load, answered) whenever its server tells its load with answers, and
    # `async read_load() -> int | None`, the server's load now (None: it does not count one).


class BackendSource(Protocol):
    """Where a routing client finds its backends."""

    async def connect(self, wait_seconds: float) -> tuple[Mapping[str, Backend], dict[str, BaseException]]:
        """The backends by server id, and why those that do not serve yet did not (they start
        out of rotation). Waits up to `wait_seconds` for the servers to be there."""
        ...

    async def aclose(self) -> None:
        """Release what the backends hold in this event loop (connections)."""
        ...


def as_token_output(output: Any) -> TokenOutput:
    """verl's TokenOutput, what its agent loops take, for a backend's answer: our engines answer
    with an EngineOutput (engines/base.py, which keeps verl out of their processes), verl's own
    servers with a TokenOutput."""
    if isinstance(output, TokenOutput):
        return output
    # model_construct: the engine built the fields with their types; validating every token id
    # again would be per-turn work in the shard worker for nothing.
    return TokenOutput.model_construct(
        token_ids=output.token_ids,
        log_probs=output.log_probs,
        routed_experts=output.routed_experts,
        stop_reason=output.stop_reason,
        num_preempted=output.num_preempted,
        extra_fields=dict(output.extra_fields),
    )


class RayReplicaBackend:
    """The server actor of one booted verl replica (`hf`, `instant`, `sglang`, `vllm`)."""

    # An actor that died (ActorDiedError) or is restarting (ActorUnavailableError, a subclass).
    server_failures: tuple[type[BaseException], ...] = (RayActorError,)
    probe_interval = 1.0

    def __init__(self, handle: Any, config: DictConfig):
        self.handle = handle
        rollout = config.actor_rollout_ref.rollout
        self._engine = rollout.name
        self._full_determinism = bool(rollout.get("full_determinism", False))
        # Our engine servers take many requests per Ray call (request_batching.py); verl's SGLang
        # and vLLM servers one. A batcher belongs to the event loop it was made in.
        self._batches = hasattr(handle, BATCH_METHOD)
        self._batchers: dict[asyncio.AbstractEventLoop, RequestBatcher] = {}
        self._on_load: LoadReport | None = None

    def watch_load(self, report: LoadReport) -> None:
        """Our engine servers send their load with each group of answers (server.EngineServer)."""
        self._on_load = report

    async def read_load(self) -> int | None:
        """The server's load now: our engine servers count it; verl's SGLang and vLLM servers do not."""
        if not self._batches:
            return None
        return int(await self.handle.load.remote())

    async def generate(
        self,
        request_id: str,
        *,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        image_data: list[Any] | None = None,
        video_data: list[Any] | None = None,
        audio_data: list[Any] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> TokenOutput:
        # The call verl's LLMServerClient.generate makes on a replica server (verl 0.9.1; a test
        # compares the two): each turn a fresh request id unless full_determinism, multimodal
        # arguments in the shape each server takes, priority for vLLM only.
        extra: dict[str, Any] = {}
        if audio_data is not None:
            extra["audio_data"] = audio_data
        if mm_processor_kwargs:
            extra["mm_processor_kwargs"] = mm_processor_kwargs
        mm_processor_output = kwargs.pop("mm_processor_output", None)
        if self._engine == "sglang":
            video_data = mm_processor_output
        priority = kwargs.pop("priority", 0)
        if priority != 0 and self._engine == "vllm":
            extra["priority"] = priority
        if self._batches:
            # Our own engines (hf, instant, ...) also get the agent loop's id, stable across the
            # turns of one trajectory, as `trajectory_key`: what hf's later_turns_first
            # recognises a later turn by (engines/hf/admission.py). verl's servers take no such
            # argument.
            extra["trajectory_key"] = request_id
        call = dict(
            request_id=request_id if self._full_determinism else uuid.uuid4().hex,
            prompt_ids=prompt_ids,
            sampling_params=sampling_params,
            image_data=image_data,
            video_data=video_data,
            **extra,
            **kwargs,
        )
        if not self._batches:
            return await self.handle.generate.remote(**call)
        loop = asyncio.get_running_loop()
        batcher = self._batchers.get(loop)
        if batcher is None:
            batcher = self._batchers[loop] = RequestBatcher(self.handle, on_load=self._on_load)
        return await batcher.call(call)

    async def probe(self) -> bool:
        try:
            await self.handle.__ray_ready__.remote()
            return True
        except ActorUnavailableError:
            # Restarting (the engine loads its model again): ask again shortly.
            return False
        except RayActorError as exc:
            # ActorDiedError: out of restarts (or killed on purpose); it never comes back.
            raise ServerGone(f"{type(exc).__name__}: {exc}") from exc
