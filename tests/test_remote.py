"""`rollout.name=remote`: routing, failover and failure classification over OpenAI-compatible
servers, against scripted servers that fail on cue (the real vLLM server: test_remote_vllm.py)."""

from __future__ import annotations

import asyncio
import socket

import pytest

from generation_core.config.layout import remote_urls
from generation_core.config.loading import load_config
from generation_core.engines.base import SamplingParams
from generation_core.engines.remote import (
    CompletionsServers,
    RemoteRequestRejected,
    RemoteServerUnavailable,
    check_servers,
    completion_request,
    parse_completion,
)
from generation_core.errors import GenrunError
from generation_core.serving.request_retry import RetryingClient
from generation_core.serving.routing import RoutingClient
from tests.scripted_server import ScriptedServer

pytestmark = pytest.mark.timeout(120)

SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True}


def _cfg(urls, *extra):
    return load_config(
        [
            "actor_rollout_ref.rollout.name=remote",
            f"actor_rollout_ref.rollout.engine_kwargs.remote.base_urls=[{','.join(urls)}]",
            "actor_rollout_ref.rollout.engine_kwargs.remote.health_interval=0.2",
            "data.max_response_length=4",
            *extra,
        ]
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def servers():
    started = [ScriptedServer(delay=0.2), ScriptedServer(delay=0.2)]
    yield started
    for server in started:
        server.stop()


def _client(cfg):
    # Distinct prompts where a test wants requests spread: generation.routing's default groups
    # requests with one prompt on one server (tests/test_scheduling.py).
    return RoutingClient(cfg, CompletionsServers(cfg))


def test_request_is_token_ids_in_and_out():
    body = completion_request(
        "m", [5, 6, 7], SamplingParams.from_request(SAMPLING | {"top_k": 20, "seed": 3}), max_tokens=9
    )
    assert body["prompt"] == [5, 6, 7] and body["max_tokens"] == 9 and body["top_k"] == 20 and body["seed"] == 3
    assert body["return_token_ids"] and body["return_tokens_as_token_ids"]
    assert "repetition_penalty" not in body  # 1.0 is every server's default
    vllm_shape = {
        "choices": [{"token_ids": [8, 9], "finish_reason": "stop", "logprobs": {"token_logprobs": [-0.1, -0.2]}}]
    }
    sglang_shape = {
        "choices": [
            {
                "text": "x",
                "finish_reason": "length",
                "logprobs": {"tokens": ["token_id:8", "token_id:9"], "token_logprobs": [-0.1, None]},
            }
        ]
    }
    assert parse_completion(vllm_shape, True).token_ids == [8, 9]
    out = parse_completion(sglang_shape, True)
    assert out.token_ids == [8, 9] and out.log_probs[0] == -0.1 and out.log_probs[1] == float("-inf")
    assert parse_completion(vllm_shape, False).log_probs is None


def test_sampling_params_are_parsed_once_and_forwarded():
    params = SamplingParams.from_request(
        SAMPLING | {"repetition_penalty": 1.1, "stop_token_ids": [2, 7], "ignore_eos": True}
    )
    body = completion_request("m", [1], params, max_tokens=3)
    assert body["repetition_penalty"] == 1.1 and body["stop_token_ids"] == [2, 7] and body["ignore_eos"] is True
    assert "top_k" not in body and "seed" not in body  # top_k=-1 and no seed: the servers' defaults


def test_text_only_answer_is_refused_not_retokenized():
    with pytest.raises(RemoteServerUnavailable, match="no token ids"):
        parse_completion({"choices": [{"text": "hello", "logprobs": None}]}, False)


@pytest.mark.parametrize(
    "urls, message",
    [
        ([], "needs the servers' base URLs"),
        (["ftp://x:1"], "invalid URL"),
        (["http://a:1", "http://a:1/v1/"], "twice"),
    ],
)
def test_bad_server_lists_are_refused(urls, message):
    overrides = ["actor_rollout_ref.rollout.name=remote"]
    if urls:
        overrides.append(f"actor_rollout_ref.rollout.engine_kwargs.remote.base_urls=[{','.join(urls)}]")
    with pytest.raises(GenrunError, match=message):
        load_config(overrides)


def test_urls_are_normalized():
    cfg = _cfg(["http://127.0.0.1:8000/v1/", "https://h.example:443"])
    assert remote_urls(cfg) == ["http://127.0.0.1:8000", "https://h.example:443"]


def test_least_outstanding_and_sticky(servers):
    cfg = _cfg([s.url for s in servers])

    async def scenario():
        client = _client(cfg)
        try:
            outs = await asyncio.gather(
                *[client.generate(f"r{i}", prompt_ids=[100 + i, 1], sampling_params=SAMPLING) for i in range(8)]
            )
            # A second turn of r0 goes where r0 went (the server's prefix cache has it).
            first = client.server_of("r0")
            await client.generate("r0", prompt_ids=[100, 1, 2], sampling_params=SAMPLING)
            return outs, first
        finally:
            await client.aclose()

    outs, first = asyncio.run(scenario())
    assert [o.token_ids for o in outs] == [[101 + i + k for k in range(4)] for i in range(8)]
    assert all(o.log_probs == [-0.5] * 4 for o in outs)
    # 8 concurrent requests over 2 equally slow servers: 4 each.
    assert sorted(len(s.requests) for s in servers) in ([4, 5], [5, 4])
    sticky_server = next(s for s in servers if s.url == first)
    assert sticky_server.requests[-1]["prompt"] == [100, 1, 2]


def test_4xx_fails_the_sample_and_keeps_the_server(servers):
    cfg = _cfg([s.url for s in servers])
    servers[0].fail_next = [400]
    servers[1].fail_next = [400]

    async def scenario():
        client = _client(cfg)
        retrying = RetryingClient(client, retries=3, backoff_seconds=0.01, timeout=None)
        try:
            with pytest.raises(RemoteRequestRejected, match="400"):
                await retrying.generate("bad", prompt_ids=[1], sampling_params=SAMPLING)
            rejected = len(servers[0].requests) + len(servers[1].requests)
            for server in servers:
                server.fail_next.clear()
            await asyncio.gather(
                *[retrying.generate(f"ok{i}", prompt_ids=[10 + i], sampling_params=SAMPLING) for i in range(4)]
            )
            return retrying.stats, client.replica_failures, rejected
        finally:
            await client.aclose()

    stats, failures, rejected = asyncio.run(scenario())
    assert rejected == 1 and stats.retries == 0 and stats.failed == 1
    assert failures == 0
    assert all(len(s.requests) >= 2 for s in servers)  # both still served after the 400


def test_dead_server_is_retried_elsewhere_and_rejoins_when_back():
    alive = ScriptedServer()
    dead_port = _free_port()
    cfg = _cfg([alive.url, f"http://127.0.0.1:{dead_port}"])
    revived = None

    async def scenario():
        nonlocal revived
        client = _client(cfg)
        retrying = RetryingClient(client, retries=3, backoff_seconds=0.01, timeout=None)
        try:
            outs = await asyncio.gather(
                *[retrying.generate(f"r{i}", prompt_ids=[10 * i + 1], sampling_params=SAMPLING) for i in range(6)]
            )
            assert f"http://127.0.0.1:{dead_port}" in client.down
            revived = ScriptedServer(port=dead_port)
            for _ in range(100):
                if not client.down:
                    break
                await asyncio.sleep(0.1)
            assert not client.down, "the server that came back was not put back in rotation"
            await asyncio.gather(
                *[retrying.generate(f"s{i}", prompt_ids=[20 + i], sampling_params=SAMPLING) for i in range(6)]
            )
            return outs, client.replica_failures
        finally:
            await client.aclose()

    try:
        outs, failures = asyncio.run(scenario())
    finally:
        alive.stop()
        if revived:
            revived.stop()
    assert len(outs) == 6 and all(len(o.token_ids) == 4 for o in outs)
    assert failures == 1
    assert len(revived.requests) >= 1  # back in rotation: it gets work again


def test_5xx_takes_the_server_out_and_the_request_goes_elsewhere(servers):
    cfg = _cfg([s.url for s in servers])
    servers[0].fail_next = [500] * 100
    servers[0].healthy = False

    async def scenario():
        client = _client(cfg)
        retrying = RetryingClient(client, retries=3, backoff_seconds=0.01, timeout=None)
        try:
            # Distinct prompts: the default routing keeps one prompt's requests on one server,
            # which half the time would be the healthy one and leave nothing to fail over.
            outs = await asyncio.gather(
                *[retrying.generate(f"r{i}", prompt_ids=[30 + i], sampling_params=SAMPLING) for i in range(6)]
            )
            return outs, client.replica_failures, retrying.stats
        finally:
            await client.aclose()

    outs, failures, stats = asyncio.run(scenario())
    assert len(outs) == 6 and failures == 1
    assert len(servers[0].requests) >= 1 and len(servers[1].requests) == 6
    assert stats.failed == 0


def test_sglang_style_ids_and_api_key(servers):
    server = ScriptedServer(ids_as_tokens=True)
    cfg = _cfg([server.url], "actor_rollout_ref.rollout.engine_kwargs.remote.api_key=sekrit")

    async def scenario():
        client = _client(cfg)
        try:
            return await client.generate("r", prompt_ids=[7], sampling_params=SAMPLING)
        finally:
            await client.aclose()

    try:
        out = asyncio.run(scenario())
    finally:
        server.stop()
    assert out.token_ids == [8, 9, 10, 11]


def test_api_key_is_sent_as_a_bearer_header_on_every_request():
    keyed, open_server = ScriptedServer(), ScriptedServer()
    key = "actor_rollout_ref.rollout.engine_kwargs.remote.api_key=sekrit"
    # With the model named, the connect probe is /health (else /v1/models).
    model = "actor_rollout_ref.rollout.engine_kwargs.remote.model=scripted-model"

    async def check_then_generate(cfg):
        # What a run sends: the preflight's model check, the connect probe, a completion.
        await check_servers(cfg)
        client = _client(cfg)
        try:
            await client.connect()
            return await client.generate("r", prompt_ids=[7], sampling_params=SAMPLING)
        finally:
            await client.aclose()

    try:
        assert asyncio.run(check_then_generate(_cfg([keyed.url], key, model))).token_ids == [8, 9, 10, 11]
        assert asyncio.run(check_then_generate(_cfg([open_server.url], model))).token_ids == [8, 9, 10, 11]
    finally:
        keyed.stop()
        open_server.stop()
    paths = {path for _, path, _ in keyed.received}
    assert {"/v1/models", "/health", "/v1/completions"} <= paths, paths
    for method, path, headers in keyed.received:
        assert headers.get("authorization") == "Bearer sekrit", (method, path, headers)
    assert {path for _, path, _ in open_server.received} == paths
    assert all("authorization" not in headers for _, _, headers in open_server.received), (
        "no api_key: no Authorization header"
    )


def test_preflight_refuses_when_no_server_answers_and_names_them():
    ports = [_free_port(), _free_port()]
    cfg = _cfg([f"http://127.0.0.1:{p}" for p in ports])
    with pytest.raises(GenrunError) as err:
        asyncio.run(check_servers(cfg))
    assert all(str(p) in str(err.value) for p in ports) and "none of the 2" in str(err.value)


def test_preflight_refuses_servers_of_different_models_or_a_wrong_name():
    a, b = ScriptedServer(model="a"), ScriptedServer(model="b")
    try:
        with pytest.raises(GenrunError, match="different models"):
            asyncio.run(check_servers(_cfg([a.url, b.url])))
        with pytest.raises(GenrunError, match="not engine_kwargs.remote.model='c'"):
            asyncio.run(check_servers(_cfg([a.url], "actor_rollout_ref.rollout.engine_kwargs.remote.model=c")))
        assert asyncio.run(check_servers(_cfg([a.url]))) == {a.url: "a"}
    finally:
        a.stop()
        b.stop()


def test_api_key_is_not_written_to_run_json():
    from omegaconf import OmegaConf

    from generation_core.store.run_folder import config_without_secrets

    cfg = _cfg(["http://127.0.0.1:1"], "actor_rollout_ref.rollout.engine_kwargs.remote.api_key=sekrit")
    stored = config_without_secrets(OmegaConf.to_container(cfg, resolve=True))
    assert "sekrit" not in str(stored)
    assert stored["actor_rollout_ref"]["rollout"]["engine_kwargs"]["remote"]["base_urls"] == ["http://127.0.0.1:1"]
