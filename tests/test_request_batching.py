"""Many engine requests per Ray call (generation_core/engines/request_batching.py), on a real Ray actor:
every request gets its own answer (the one a direct call gives), fewer calls than requests, a
short answer is not held back by a long one in the same call, one request's error stays its
own, and a replica that dies under a batch fails every request of it as a server failure."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
import ray
from omegaconf import OmegaConf
from ray.exceptions import RayActorError

from generation_core.engines.instant import InstantEngine, InstantSettings
from generation_core.engines.server import EngineServer
from generation_core.serving.backends import RayReplicaBackend

pytestmark = pytest.mark.timeout(120)

SAMPLING = {"temperature": 0.0, "logprobs": True}


class CountingServer(EngineServer):
    """An instant-engine server that counts its batched calls; prompts starting with 9 wait
    `prompt[1]` tenths of a second, a prompt starting with 7 kills the process."""

    def __init__(self):
        super().__init__(lambda: InstantEngine(InstantSettings(prompt_length=64, response_length=16, eos_token_id=2)))
        self.batches = 0
        self.requests_in_batches = 0

    async def serve_batch(self, requests):
        self.batches += 1
        self.requests_in_batches += len(requests)
        async for answers in super().serve_batch(requests):
            yield answers

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs):
        if prompt_ids[0] == 9:
            await asyncio.sleep(prompt_ids[1] / 10)
        if prompt_ids[0] == 7:
            os.kill(os.getpid(), signal.SIGKILL)
        return await super().generate(request_id, prompt_ids=prompt_ids, sampling_params=sampling_params, **kwargs)

    def counts(self):
        return self.batches, self.requests_in_batches


def _config():
    return OmegaConf.create({"actor_rollout_ref": {"rollout": {"name": "instant", "full_determinism": False}}})


@pytest.fixture
def server(ray_local):
    handle = ray.remote(CountingServer).options(max_concurrency=1000).remote()
    ray.get(handle.health.remote())
    yield handle
    ray.kill(handle)


def test_many_requests_go_in_few_calls_and_each_gets_its_own_answer(server):
    backend = RayReplicaBackend(server, _config())
    prompts = [[3, i, i + 1] for i in range(300)]

    async def scenario():
        return await asyncio.gather(
            *(backend.generate(f"r{i}", prompt_ids=p, sampling_params=SAMPLING) for i, p in enumerate(prompts))
        )

    outputs = asyncio.run(scenario())
    direct = [
        ray.get(server.generate.remote(f"d{i}", prompt_ids=p, sampling_params=SAMPLING)) for i, p in enumerate(prompts)
    ]
    assert [o.token_ids for o in outputs] == [d.token_ids for d in direct]
    assert [o.log_probs for o in outputs] == [d.log_probs for d in direct]
    assert all(len(o.token_ids) == 8 for o in outputs)
    batches, requests = ray.get(server.counts.remote())
    assert requests == 300
    assert batches < 300 / 10, f"{batches} Ray calls for 300 requests sent together"


def test_the_replica_sends_its_load_with_its_answers_and_tells_it_when_asked(server):
    """The shared load routing uses (serving/replica_loads.py): every group of answers comes with
    the replica's count of the requests it still holds, and `load()` answers it directly."""
    backend = RayReplicaBackend(server, _config())
    reports: list[tuple[int, int]] = []
    backend.watch_load(lambda load, answered: reports.append((load, answered)))

    async def scenario():
        # One request held 0.3 s ([9, 3]) and four at once: the fast ones' report counts it.
        slow = asyncio.ensure_future(backend.generate("slow", prompt_ids=[9, 3], sampling_params=SAMPLING))
        await asyncio.gather(
            *(backend.generate(f"f{i}", prompt_ids=[3, i], sampling_params=SAMPLING) for i in range(4))
        )
        held = await backend.read_load()
        await slow
        return held, await backend.read_load()

    held, after = asyncio.run(scenario())
    assert (held, after) == (1, 0)
    assert sum(answered for _, answered in reports) == 5, "every answer came with a report"
    assert reports[-1] == (0, 1), "the slow answer last, nothing left behind it"
    assert all(load >= 1 for load, _ in reports[:-1]), "the slow request was held while the others were answered"


def test_a_short_answer_is_not_held_back_by_a_long_one_in_the_same_call(server):
    backend = RayReplicaBackend(server, _config())
    finished: dict[str, float] = {}

    async def one(name, prompt):
        await backend.generate(name, prompt_ids=prompt, sampling_params=SAMPLING)
        finished[name] = time.monotonic()

    async def scenario():
        await asyncio.gather(one("long", [9, 30]), one("short", [3, 4]))

    started = time.monotonic()
    asyncio.run(scenario())
    assert ray.get(server.counts.remote())[0] == 1, "both requests went in one call"
    assert finished["long"] - started >= 3.0
    assert finished["short"] < finished["long"] - 2.0, "the short answer came back when it was ready"


def test_one_requests_error_stays_its_own(server):
    backend = RayReplicaBackend(server, _config())

    async def scenario():
        bad = backend.generate("bad", prompt_ids=[3, 1], sampling_params={"temperature": -1.0})
        good = [backend.generate(f"g{i}", prompt_ids=[3, i], sampling_params=SAMPLING) for i in range(5)]
        return await asyncio.gather(bad, *good, return_exceptions=True)

    bad, *good = asyncio.run(scenario())
    assert isinstance(bad, ValueError) and "temperature" in str(bad)
    assert all(len(o.token_ids) == 8 for o in good)
    assert ray.get(server.counts.remote())[0] == 1


def test_a_replica_dying_under_a_batch_fails_each_of_its_requests_as_a_server_failure(server):
    backend = RayReplicaBackend(server, _config())

    async def scenario():
        doomed = [backend.generate(f"w{i}", prompt_ids=[9, 20], sampling_params=SAMPLING) for i in range(4)]
        killer = backend.generate("kill", prompt_ids=[7], sampling_params=SAMPLING)
        return await asyncio.gather(*doomed, killer, return_exceptions=True)

    results = asyncio.run(scenario())
    assert len(results) == 5
    assert all(isinstance(r, backend.server_failures) for r in results), results
    assert all(isinstance(r, RayActorError) for r in results)
