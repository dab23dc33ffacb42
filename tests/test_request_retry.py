"""Engine requests: transient failures retried with backoff, invalid requests, programming
errors and exhausted retries raised, timeouts enforced; the Ray wrapping of an engine's
exception keeps its type; a failed sample keeps its traceback."""

from __future__ import annotations

import asyncio

import pytest
from ray.exceptions import ActorDiedError, ActorUnavailableError, GetTimeoutError

from generation_core.engines.base import EngineStepFailed, EngineStopped
from generation_core.engines.remote import RemoteRequestRejected, RemoteServerUnavailable
from generation_core.errors import GenrunError
from generation_core.serving.request_retry import RequestTimeout, RetryingClient, is_transient
from generation_core.store.trajectory_record import SampleFailure

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


@pytest.mark.parametrize(
    "error",
    [
        KeyError("prompt_ids"),
        AttributeError("'NoneType' object has no attribute 'token_ids'"),
        AssertionError("broken invariant"),
        IndexError("list index out of range"),
        NotImplementedError("todo"),
        GenrunError("every inference replica of the pool died"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_programming_errors_and_final_verdicts_are_not_retried(error):
    engine = Engine([error, error])
    client = RetryingClient(engine, retries=3, backoff_seconds=0, timeout=None)
    with pytest.raises(type(error)):
        _call(client)
    assert engine.calls == 1 and client.stats.retries == 0 and client.stats.failed == 1


def test_only_errors_that_may_pass_are_transient():
    transient = [
        ConnectionResetError("reset by peer"),
        TimeoutError("read timed out"),
        RequestTimeout("took longer than generation.request_timeout"),
        GetTimeoutError("get timed out"),
        ActorDiedError(),
        ActorUnavailableError("restarting", None),
        RemoteServerUnavailable("http://10.0.0.5:8000 answered 503"),
        EngineStopped("transformers engine shut down before it answered"),
        EngineStepFailed("transformers engine: a batch step failed with RuntimeError: CUDA error"),
    ]
    permanent = [
        KeyError("x"),
        AttributeError("x"),
        AssertionError("x"),
        NameError("x"),
        ZeroDivisionError("x"),
        RecursionError("x"),
        ValueError("x"),
        TypeError("x"),
        RemoteRequestRejected("400: prompt too long"),
        GenrunError("x"),
        FileNotFoundError("x"),
    ]
    assert [type(e).__name__ for e in transient if not is_transient(e)] == []
    assert [type(e).__name__ for e in permanent if is_transient(e)] == []


def _raise_in_loop_code():
    return {}["reward_model"]


def test_a_failed_sample_records_its_traceback():
    try:
        _raise_in_loop_code()
    except KeyError as exc:
        failure = SampleFailure.from_exception((3, 1), exc)
    assert failure.error == "KeyError: 'reward_model'"
    assert "Traceback (most recent call last)" in failure.traceback and "_raise_in_loop_code" in failure.traceback
    assert failure.traceback.rstrip().endswith("KeyError: 'reward_model'")


def test_a_programming_error_in_a_ray_actor_fails_at_once_with_the_actors_traceback(ray_local):
    import ray

    @ray.remote
    class Broken:
        def generate(self):
            return _raise_in_loop_code()

    actor = Broken.remote()
    with pytest.raises(KeyError) as raised:
        ray.get(actor.generate.remote())
    assert is_transient(raised.value) is False
    failure = SampleFailure.from_exception((0, 0), raised.value)
    assert failure.error == "KeyError: 'reward_model'"
    assert "_raise_in_loop_code" in failure.traceback, failure.traceback
    ray.kill(actor)
