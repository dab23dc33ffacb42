"""Engine requests: transient failures retried with backoff, invalid requests and exhausted
retries raised, timeouts enforced; the Ray wrapping of an engine's exception keeps its type."""

from __future__ import annotations

import asyncio

import pytest

from generation_core.request_retry import RequestTimeout, RetryingClient, is_transient

pytestmark = pytest.mark.timeout(120)


class Engine:
    def __init__(self, errors=(), delay=0.0):
        self.errors = list(errors)
        self.delay = delay
        self.calls = 0

    async def generate(self, request_id, *, prompt_ids, sampling_params):
        self.calls += 1
        if self.delay:
            await asyncio.sleep(self.delay)
        if self.errors:
            raise self.errors.pop(0)
        return ("tokens for", request_id, list(prompt_ids))

    tokenizer = "the engine's tokenizer"


def _call(client):
    return asyncio.run(client.generate("r1", prompt_ids=[1, 2], sampling_params={}))


def test_transient_errors_are_retried_until_success():
    engine = Engine([ConnectionError("reset"), RuntimeError("engine hiccup")])
    client = RetryingClient(engine, retries=2, backoff_seconds=0.01, timeout=None)
    assert _call(client) == ("tokens for", "r1", [1, 2])
    assert engine.calls == 3 and client.stats.retries == 2 and client.stats.failed == 0
    assert client.tokenizer == "the engine's tokenizer", "other attributes come from the wrapped client"


def test_exhausted_retries_raise_the_last_error():
    engine = Engine([RuntimeError("down")] * 5)
    client = RetryingClient(engine, retries=2, backoff_seconds=0, timeout=None)
    with pytest.raises(RuntimeError, match="down"):
        _call(client)
    assert engine.calls == 3 and client.stats.failed == 1 and client.stats.errors == {"RuntimeError": 3}


def test_invalid_requests_are_not_retried():
    engine = Engine([ValueError("prompt longer than the context")])
    client = RetryingClient(engine, retries=5, backoff_seconds=0, timeout=None)
    with pytest.raises(ValueError):
        _call(client)
    assert engine.calls == 1


def test_a_request_past_the_timeout_is_retried_then_fails():
    engine = Engine(delay=0.5)
    client = RetryingClient(engine, retries=1, backoff_seconds=0, timeout=0.05)
    with pytest.raises(RequestTimeout, match="generation.request_timeout=0.05"):
        _call(client)
    assert engine.calls == 2


def test_ray_keeps_the_type_of_an_engine_exception(ray_local):
    """What the Ray actor path raises: a RayTaskError that is also the engine's exception type."""
    import ray

    @ray.remote
    class Failing:
        def invalid(self):
            raise ValueError("bad sampling params")

        def broken(self):
            raise RuntimeError("CUDA error")

    actor = Failing.remote()
    for method, transient in ((actor.invalid, False), (actor.broken, True)):
        with pytest.raises(Exception) as raised:
            ray.get(method.remote())
        assert is_transient(raised.value) is transient
    ray.kill(actor)
