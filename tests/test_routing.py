"""The routing client over fake backends: least outstanding, sticky turns, hash routing, failover
(out of rotation, probed, back in rotation, gone for good, all gone), and the Ray replica
backend's call shape against verl's own LLMServerClient."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from typing import Any

import pytest
from omegaconf import OmegaConf
from ray.exceptions import ActorDiedError, ActorUnavailableError
from verl.workers.rollout.llm_server import LLMServerClient
from verl.workers.rollout.replica import TokenOutput

import generation_core.serving.routing as routing
from generation_core.errors import GenrunError
from generation_core.serving.backends import RayReplicaBackend, ServerGone
from generation_core.serving.routing import RoutingClient
from tests.conftest import REPO

pytestmark = pytest.mark.timeout(60)

SAMPLING = {"temperature": 1.0, "logprobs": False}


class ServerDown(ConnectionError):
    """A fake backend's server failure."""


class FakeBackend:
    server_failures = (ServerDown,)
    probe_interval = 0.01

    def __init__(self, name: str, delay: float = 0.0):
        self.name = name
        self.delay = delay
        self.requests: list[str] = []
        self.fail_next: list[BaseException] = []
        self.probe_answers: list[bool | BaseException] = []
        """What the next probes answer, in order; then True."""
        self.probes = 0

    async def generate(
        self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any], **kwargs: Any
    ) -> TokenOutput:
        self.requests.append(request_id)
        if self.delay:
            await asyncio.sleep(self.delay)
        if self.fail_next:
            raise self.fail_next.pop(0)
        return TokenOutput(token_ids=[len(prompt_ids)], stop_reason="completed", extra_fields={"served_by": self.name})

    async def probe(self) -> bool:
        self.probes += 1
        answer = self.probe_answers.pop(0) if self.probe_answers else True
        if isinstance(answer, BaseException):
            raise answer
        return answer


class FakeSource:
    def __init__(self, backends: dict[str, FakeBackend], unanswered: dict[str, BaseException] | None = None):
        self.backends = backends
        self.unanswered = unanswered or {}
        self.connects = 0
        self.closed = False

    async def connect(self, wait_seconds: float = 0.0):
        self.connects += 1
        await asyncio.sleep(0.01)
        return dict(self.backends), dict(self.unanswered)

    async def aclose(self) -> None:
        self.closed = True


def _config(name: str = "hf", full_determinism: bool = False, routing: str = "least_loaded"):
    """`least_loaded`: these tests send one prompt many times (prefix affinity would group them;
    tests/test_scheduling.py pins the groups)."""
    return OmegaConf.create(
        {
            "actor_rollout_ref": {"rollout": {"name": name, "full_determinism": full_determinism}},
            "generation": {"routing": routing},
        }
    )


def _client(*backends: FakeBackend, unanswered=None, **config) -> tuple[RoutingClient, FakeSource]:
    source = FakeSource({b.name: b for b in backends}, unanswered)
    return RoutingClient(_config(**config), source), source


async def _generate(client: RoutingClient, request_id: str, prompt_ids=(1,)) -> TokenOutput:
    return await client.generate(request_id, prompt_ids=list(prompt_ids), sampling_params=SAMPLING)


async def _until(condition, seconds: float = 5.0) -> None:
    for _ in range(int(seconds / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")


def test_least_outstanding_sticky_turns_and_one_shared_connect():
    a, b = FakeBackend("a", delay=0.05), FakeBackend("b", delay=0.05)
    client, source = _client(a, b)

    async def scenario():
        outs = await asyncio.gather(*[_generate(client, f"r{i}") for i in range(8)])
        # 8 concurrent requests over 2 equally slow backends: 4 each.
        counts = sorted(len(s.requests) for s in (a, b))
        # A second turn of r3 goes where its first went; the next new request to the other
        # backend, which has fewer requests outstanding.
        await asyncio.gather(_generate(client, "r3", (1, 2)), _generate(client, "x"))
        await client.aclose()
        return outs, counts

    outs, counts = asyncio.run(scenario())
    assert source.connects == 1, "concurrent first requests share one connect"
    assert [o.token_ids for o in outs] == [[1]] * 8
    assert counts == [4, 4]
    sticky = {"a": a, "b": b}[client.server_of("r3")]
    other = b if sticky is a else a
    assert sticky.requests.count("r3") == 2 and other.requests[-1] == "x"
    assert source.closed


def test_the_global_steps_fields_verl_adds_are_set():
    client, _ = _client(FakeBackend("a"))
    out = asyncio.run(_generate(client, "r"))
    assert out.extra_fields == {"served_by": "a", "min_global_steps": None, "max_global_steps": None}


def test_an_engine_output_reads_as_verls_token_output_and_reaches_the_agent_loop_as_one():
    """Our engines answer with EngineOutput (their processes import no verl): it has exactly
    TokenOutput's fields and defaults (an agent loop reads either), and the client turns it into
    a TokenOutput with every value kept."""
    import dataclasses

    from generation_core.engines.base import EngineOutput

    fields = {f.name: f for f in dataclasses.fields(EngineOutput)}
    assert list(fields) == list(TokenOutput.model_fields)
    bare = EngineOutput(token_ids=[1])
    assert all(
        getattr(bare, name) == info.get_default(call_default_factory=True)
        for name, info in TokenOutput.model_fields.items()
        if name != "token_ids"
    )

    class EngineBackend(FakeBackend):
        async def generate(self, request_id, **kwargs):
            return EngineOutput(
                token_ids=[4, 5], log_probs=[-0.5, -0.25], stop_reason="length", num_preempted=0, extra_fields={"k": 1}
            )

    client, _ = _client(EngineBackend("a"))
    out = asyncio.run(_generate(client, "r"))
    assert isinstance(out, TokenOutput)
    assert out.model_dump() == {
        "token_ids": [4, 5],
        "log_probs": [-0.5, -0.25],
        "routed_experts": None,
        "stop_reason": "length",
        "num_preempted": 0,
        "extra_fields": {"k": 1, "min_global_steps": None, "max_global_steps": None},
    }


def test_full_determinism_routes_by_hash_of_the_request_id():
    backends = [FakeBackend(name) for name in ("a", "b", "c")]
    client, _ = _client(*backends, full_determinism=True)

    async def scenario():
        for i in range(12):
            await _generate(client, f"det-{i}")

    asyncio.run(scenario())
    for i in range(12):
        expected = ["a", "b", "c"][routing.stable_hash(f"det-{i}") % 3]
        assert client.server_of(f"det-{i}") == expected


def _deterministic_routes() -> list[str]:
    """Where full_determinism routes det-0..det-11 over replicas a, b, c (in this process)."""
    client, _ = _client(*(FakeBackend(name) for name in ("a", "b", "c")), full_determinism=True)

    async def scenario():
        for i in range(12):
            await _generate(client, f"det-{i}")

    asyncio.run(scenario())
    return [client.server_of(f"det-{i}") for i in range(12)]


@pytest.mark.timeout(180)
def test_full_determinism_routes_an_id_to_the_same_replica_in_every_process():
    """Shard workers are separate processes: Python's str hash, salted per process, would send the
    same id to different replicas in each."""
    ours = os.environ.get("PYTHONHASHSEED", "")
    seed = str(int(ours) + 1) if ours.isdigit() else "1"  # another salt than this process's
    child = subprocess.run(
        [
            sys.executable,
            "-c",
            "import json; from tests.test_routing import _deterministic_routes; print(json.dumps(_deterministic_routes()))",
        ],
        cwd=REPO,
        env=dict(os.environ, PYTHONHASHSEED=seed),
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert child.returncode == 0, child.stderr[-2000:]
    assert json.loads(child.stdout.splitlines()[-1]) == _deterministic_routes()


def test_a_request_failure_keeps_the_server_in_rotation():
    a = FakeBackend("a")
    a.fail_next = [ValueError("prompt too long")]
    client, _ = _client(a)

    async def scenario():
        with pytest.raises(ValueError):
            await _generate(client, "bad")
        return await _generate(client, "ok")

    assert asyncio.run(scenario()).token_ids == [1]
    assert client.replica_failures == 0 and not client.down and a.probes == 0


def test_a_failed_server_leaves_the_rotation_is_probed_and_comes_back():
    a, b = FakeBackend("a"), FakeBackend("b")
    client, _ = _client(a, b)

    async def scenario():
        await _generate(client, "warm")
        failing = {"a": a, "b": b}[client.server_of("warm")]
        other = b if failing is a else a
        failing.fail_next = [ServerDown("dead"), ServerDown("dead again")]
        failing.probe_answers = [False, False, False]
        with pytest.raises(ServerDown):
            await _generate(client, "warm", (1, 2))
        assert client.down == {failing.name}
        # While it is out, every request goes to the other server, the failed one's sticky ones too.
        await asyncio.gather(*[_generate(client, f"r{i}") for i in range(4)], _generate(client, "warm", (1, 2, 3)))
        assert client.server_of("warm") == other.name
        await _until(lambda: not client.down)
        return failing

    failing = asyncio.run(scenario())
    assert client.replica_failures == 1 and not client.gone
    assert failing.probes == 4, "three 'not yet' answers, then back"


def test_requests_wait_while_no_server_is_up():
    a = FakeBackend("a")
    a.fail_next = [ServerDown("restarting")]
    a.probe_answers = [False] * 10
    client, _ = _client(a)

    async def scenario():
        with pytest.raises(ServerDown):
            await _generate(client, "r0")
        return await _generate(client, "r1")

    assert asyncio.run(scenario()).token_ids == [1]
    assert a.probes == 11 and client.replica_failures == 1


def test_gone_for_good_and_every_server_gone_is_an_error():
    a, b = FakeBackend("a"), FakeBackend("b")
    a.probe_answers = [ServerGone("out of restarts")]
    client, _ = _client(a, b, unanswered={"a": ServerDown("did not answer at connect")})

    async def scenario():
        # "a" never answered: out of rotation from the start, then gone.
        await _generate(client, "r0")
        await _until(lambda: client.gone == {"a"})
        assert client.server_of("r0") == "b"
        b.fail_next = [ServerDown("dead")]
        b.probe_answers = [ServerGone("dead")]
        with pytest.raises(ServerDown):
            await _generate(client, "r1")
        await _until(lambda: client.gone == {"a", "b"})
        with pytest.raises(GenrunError, match="every inference replica of the pool died"):
            await _generate(client, "r2")

    asyncio.run(scenario())
    assert client.replica_failures == 2


def test_a_server_not_back_in_time_is_gone(monkeypatch):
    monkeypatch.setattr(routing, "REPLICA_RECOVERY_SECONDS", 0.1)
    a, b = FakeBackend("a"), FakeBackend("b")
    a.probe_answers = [False] * 1000
    client, _ = _client(a, b, unanswered={"a": ServerDown("no answer")})

    async def scenario():
        await client.connect()
        await _until(lambda: client.gone == {"a"})

    asyncio.run(scenario())
    assert not client.down


def test_aclose_stops_the_probes():
    a, b = FakeBackend("a"), FakeBackend("b")
    a.probe_answers = [False] * 1000
    client, source = _client(a, b, unanswered={"a": ServerDown("no answer")})

    async def scenario():
        await client.connect()
        await _until(lambda: a.probes >= 2)
        await asyncio.wait_for(client.aclose(), 1.0)
        probes = a.probes
        await asyncio.sleep(0.1)
        return probes

    probes = asyncio.run(scenario())
    assert a.probes == probes, "no probe after aclose"
    assert source.closed


# ---- the Ray replica backend -------------------------------------------------------------------


class _Method:
    def __init__(self, fn):
        self._fn = fn

    def remote(self, *args, **kwargs):
        return self._fn(*args, **kwargs)


class RecordingHandle:
    """What a replica server actor's handle looks like to its callers."""

    def __init__(self, ready: list[BaseException | None] | None = None):
        self.calls: list[dict[str, Any]] = []
        self.ready = list(ready or [])
        self.generate = _Method(self._generate)
        self.__ray_ready__ = _Method(self._ready)

    async def _generate(self, **kwargs):
        self.calls.append(kwargs)
        return TokenOutput(token_ids=[1], stop_reason="completed")

    async def _ready(self):
        error = self.ready.pop(0) if self.ready else None
        if error is not None:
            raise error
        return True


class _VerlClientOn(LLMServerClient):
    """verl's own client, its balancer replaced by one fixed server (to record its call)."""

    def __init__(self, config, handle):
        super().__init__(config)
        self._handle = handle

    async def _acquire_server(self, request_id, **extra):
        return "s0", self._handle

    def _release_server(self, server_id, request_id=None):
        pass


@pytest.mark.parametrize("engine", ["hf", "sglang", "vllm"])
@pytest.mark.parametrize("full_determinism", [False, True])
@pytest.mark.parametrize(
    "extra",
    [
        {},
        {
            "image_data": ["img"],
            "audio_data": ["aud"],
            "video_data": ["frames"],
            "mm_processor_output": {"pixel": 1},
            "mm_processor_kwargs": {"fps": 2},
            "priority": 3,
        },
        {
            "image_data": None,
            "audio_data": None,
            "video_data": None,
            "mm_processor_output": None,
            "mm_processor_kwargs": {},
            "priority": 0,
            "custom": "x",
        },
    ],
)
def test_ray_backend_makes_the_call_verls_client_makes(engine, full_determinism, extra):
    config = _config(engine, full_determinism)
    ours, verls = RecordingHandle(), RecordingHandle()

    async def scenario():
        await RayReplicaBackend(ours, config).generate("req-1", prompt_ids=[1, 2], sampling_params=SAMPLING, **extra)
        await _VerlClientOn(config, verls).generate("req-1", prompt_ids=[1, 2], sampling_params=SAMPLING, **extra)

    asyncio.run(scenario())
    ours_call, verls_call = ours.calls[0], verls.calls[0]
    if full_determinism:
        assert ours_call["request_id"] == verls_call["request_id"] == "req-1"
    else:
        # A fresh id per turn (the server sees every turn as its own request).
        assert ours_call.pop("request_id") != "req-1" and verls_call.pop("request_id") != "req-1"
    assert ours_call == verls_call


def test_ray_backend_probe_restarting_back_and_dead():
    handle = RecordingHandle(ready=[ActorUnavailableError("restarting", None), None, ActorDiedError()])
    backend = RayReplicaBackend(handle, _config())

    async def scenario():
        assert await backend.probe() is False
        assert await backend.probe() is True
        with pytest.raises(ServerGone) as gone:
            await backend.probe()
        return gone.value

    gone = asyncio.run(scenario())
    assert isinstance(gone.__cause__, ActorDiedError)
    assert issubclass(ActorUnavailableError, RayReplicaBackend.server_failures), (
        "a call to a restarting replica is a server failure"
    )
