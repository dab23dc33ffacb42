"""`rollout.name=remote`: OpenAI-compatible inference servers that already run elsewhere.

SGLang and vLLM both serve `/v1/completions` with a prompt given as token ids; asked for them,
they return the generated token ids and the sampled tokens' logprobs. Token in, token out: the
agent loop's exact prompt ids go out and the server's exact ids come back, nothing is
re-tokenized (a decode/encode round trip changes ids and breaks logprob alignment).

A `CompletionsServer` is an engine (engines/base.py) and a backend of the routing client
(routing.py): `generate` posts to /v1/completions, `probe` asks /health (or /v1/models while the
served model's name is not known yet). `CompletionsServers` finds the configured servers for a
routing client. How a response failed decides what happens next:
- 4xx (prompt beyond the context, a parameter the server refuses): the request is wrong, not
  the server. `RemoteRequestRejected`, a ValueError: not retried, the sample is recorded as
  failed, the server stays in rotation.
- no connection, a timeout, 5xx, a malformed answer: the server is in trouble.
  `RemoteServerUnavailable`: the server leaves the rotation until its /health answers again,
  and the request is retried on another server.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any

import httpx
from omegaconf import DictConfig

from generation_core.config.engine_kwargs import RemoteEngineKwargs
from generation_core.config.layout import remote_settings, remote_urls
from generation_core.engines.base import STOP_LENGTH, EngineOutput, SamplingParams, response_budget
from generation_core.errors import GenrunError
from generation_core.secrets import without_url_credentials

logger = logging.getLogger(__name__)


class RemoteRequestRejected(ValueError):
    """The server answered 4xx: this request cannot succeed as sent (never retried)."""


class RemoteServerUnavailable(ConnectionError):
    """The server did not answer properly (no connection, timeout, 5xx): try another one."""


def completion_request(model: str, prompt_ids: list[int], params: SamplingParams, max_tokens: int) -> dict[str, Any]:
    """The /v1/completions body for one agent-loop turn. Parameters at the servers' defaults
    (top_k off, no repetition penalty, ignore_eos off) are left out."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": [int(t) for t in prompt_ids],
        "max_tokens": max_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "n": 1,
        # vLLM: the generated ids in the choice; SGLang and older vLLM: ids as "token_id:N"
        # strings in the logprobs. Both asked: whichever the server has answers.
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
        "logprobs": 0,
        # Special tokens stay in the text too; the ids are what we keep.
        "skip_special_tokens": False,
    }
    if params.top_k > 0:
        body["top_k"] = params.top_k
    if params.repetition_penalty != 1.0:
        body["repetition_penalty"] = params.repetition_penalty
    if params.seed is not None:
        body["seed"] = params.seed
    if params.ignore_eos:
        body["ignore_eos"] = True
    if params.stop_token_ids is not None:
        body["stop_token_ids"] = list(params.stop_token_ids)
    return body


def parse_completion(payload: dict[str, Any], want_logprobs: bool) -> EngineOutput:
    """A /v1/completions answer -> EngineOutput (ids, and logprobs when asked)."""
    try:
        choice = payload["choices"][0]
    except (KeyError, IndexError, TypeError):
        raise RemoteServerUnavailable(f"the server's answer has no choices: {str(payload)[:200]}") from None
    logprobs = choice.get("logprobs") or {}
    token_ids = choice.get("token_ids")
    if token_ids is None:
        tokens = logprobs.get("tokens")
        if tokens is None or not all(isinstance(t, str) and t.startswith("token_id:") for t in tokens):
            raise RemoteServerUnavailable(
                "the server returned text but no token ids (it needs return_token_ids or return_tokens_as_token_ids: "
                "vLLM >= 0.10 or SGLang serve them)"
            )
        token_ids = [int(t.split(":", 1)[1]) for t in tokens]
    log_probs = None
    if want_logprobs:
        values = logprobs.get("token_logprobs")
        if values is None or len(values) != len(token_ids):
            raise RemoteServerUnavailable(
                f"the server returned {len(token_ids)} tokens but {0 if values is None else len(values)} logprobs"
            )
        # A logprob of -inf comes back as null from some servers.
        log_probs = [-math.inf if v is None else float(v) for v in values]
    # The server's finish_reason as it is: "stop" / "length" (engines/base.py's names), or its own.
    return EngineOutput(
        token_ids=[int(t) for t in token_ids], log_probs=log_probs, stop_reason=choice.get("finish_reason")
    )


class CompletionsServer:
    """One OpenAI-compatible server at `base_url`: an engine, and a backend of the routing client."""

    server_failures: tuple[type[BaseException], ...] = (RemoteServerUnavailable,)
    """What `generate` raises when the server, not the request, failed."""

    def __init__(
        self,
        base_url: str,
        http: httpx.AsyncClient,
        *,
        model: str | None,
        prompt_length: int,
        response_length: int,
        probe_interval: float = RemoteEngineKwargs.health_interval,
    ):
        self.base_url = base_url
        self.name = without_url_credentials(base_url)
        """`base_url` as messages and logs show it: its credentials (`user:pass@`, `?sig=`) masked."""
        self.http = http
        """Shared by every server of a CompletionsServers; closed there."""
        self.model = model
        """The served model's name (engine_kwargs.remote.model, else learned from /v1/models)."""
        self.prompt_length = prompt_length
        self.response_length = response_length
        self.probe_interval = probe_interval
        self.stats = {"requests": 0, "generated_tokens": 0}

    async def generate(
        self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any], **_unused: Any
    ) -> EngineOutput:
        params = SamplingParams.from_request(sampling_params)
        max_tokens = response_budget(self.prompt_length, self.response_length, len(prompt_ids), params.max_tokens)
        if max_tokens <= 0:
            return EngineOutput(token_ids=[], log_probs=[] if params.logprobs else None, stop_reason=STOP_LENGTH)
        if self.model is None:
            raise RemoteServerUnavailable(f"{self.name}: not connected (no model name yet)")
        body = completion_request(self.model, prompt_ids, params, max_tokens)
        try:
            answer = await self.http.post(self.base_url + "/v1/completions", json=body)
        except httpx.HTTPError as exc:
            raise RemoteServerUnavailable(
                f"{self.name}: {type(exc).__name__}: {without_url_credentials(str(exc))}"
            ) from None
        if 400 <= answer.status_code < 500 and answer.status_code not in (408, 429):
            raise RemoteRequestRejected(
                f"{self.name} refused request {request_id} ({answer.status_code}): {_error_message(answer)}"
            )
        if answer.status_code >= 400:
            raise RemoteServerUnavailable(f"{self.name} answered {answer.status_code}: {_error_message(answer)}")
        try:
            payload = answer.json()
        except ValueError:
            raise RemoteServerUnavailable(
                f"{self.name} answered with something that is not JSON: {without_url_credentials(answer.text[:200])!r}"
            ) from None
        output = parse_completion(payload, params.logprobs)
        self.stats["requests"] += 1
        self.stats["generated_tokens"] += len(output.token_ids)
        return output

    def shutdown(self) -> None:
        """Nothing of its own to stop: the connection pool is its CompletionsServers'."""

    async def probe(self) -> bool:
        """Whether the server serves: its /health answers, or, while the served model's name is
        not known yet, /v1/models names one (which is then the model)."""
        if self.model is not None:
            return await self.healthy()
        try:
            models = await self.models()
        except RemoteServerUnavailable:
            return False
        if models:
            self.model = models[0]
        return bool(models)

    async def models(self) -> list[str]:
        answer = await self._get("/v1/models")
        return [entry["id"] for entry in answer.json().get("data", [])]

    async def healthy(self) -> bool:
        try:
            await self._get("/health")
            return True
        except RemoteServerUnavailable:
            return False

    async def _get(self, path: str) -> httpx.Response:
        try:
            answer = await self.http.get(self.base_url + path)
        except httpx.HTTPError as exc:
            raise RemoteServerUnavailable(
                f"{self.name}: {type(exc).__name__}: {without_url_credentials(str(exc))}"
            ) from None
        if answer.status_code >= 400:
            raise RemoteServerUnavailable(f"{self.name}{path} answered {answer.status_code}")
        return answer


def _error_message(answer: httpx.Response) -> str:
    """The server's own words on a failed request (a server may echo the URL it was asked)."""
    try:
        payload = answer.json()
    except ValueError:
        return without_url_credentials(answer.text[:300])
    error = payload.get("error", payload) if isinstance(payload, dict) else payload
    message = error.get("message", error) if isinstance(error, dict) else error
    return without_url_credentials(str(message)[:300])


def open_servers(cfg: DictConfig) -> dict[str, CompletionsServer]:
    """One CompletionsServer per configured URL, sharing one connection pool, by the URL's name
    (credentials masked): the routing client logs it, and each trajectory's turns record it as
    the replica that answered."""
    settings = remote_settings(cfg)
    rollout = cfg.actor_rollout_ref.rollout
    headers = {"Authorization": f"Bearer {settings.api_key}"} if settings.api_key else {}
    urls = remote_urls(cfg)
    http = httpx.AsyncClient(
        headers=headers,
        # No read timeout: a long generation is not a dead server (generation.request_timeout
        # bounds a request when set).
        timeout=httpx.Timeout(None, connect=float(settings.connect_timeout or RemoteEngineKwargs.connect_timeout)),
        limits=httpx.Limits(
            max_connections=int(settings.max_connections or RemoteEngineKwargs.max_connections) * len(urls),
            max_keepalive_connections=None,
        ),
    )
    interval = float(settings.health_interval or RemoteEngineKwargs.health_interval)
    servers: dict[str, CompletionsServer] = {}
    for position, url in enumerate(urls):
        server = CompletionsServer(
            url,
            http,
            model=settings.model,
            prompt_length=rollout.prompt_length,
            response_length=rollout.response_length,
            probe_interval=interval,
        )
        # Two URLs that differ only in their credentials stay two servers.
        servers[server.name if server.name not in servers else f"{server.name} [{position}]"] = server
    return servers


class CompletionsServers:
    """The configured servers as the routing client's backends (`rollout.name=remote`)."""

    def __init__(self, cfg: DictConfig):
        self.cfg = cfg
        self._servers: dict[str, CompletionsServer] | None = None

    async def connect(self, wait_seconds: float = 0.0) -> tuple[dict[str, CompletionsServer], dict[str, BaseException]]:
        """The servers by URL, and why those that do not answer yet did not (they start out of
        rotation); waits up to `wait_seconds` for at least one to answer."""
        servers = open_servers(self.cfg)
        interval = next(iter(servers.values())).probe_interval
        deadline = time.monotonic() + wait_seconds
        while True:
            answered = await asyncio.gather(*[server.probe() for server in servers.values()])
            if any(answered):
                break
            if time.monotonic() >= deadline:
                await next(iter(servers.values())).http.aclose()
                raise GenrunError(
                    f"none of the {len(servers)} remote inference server(s) answers ({', '.join(servers)})"
                )
            await asyncio.sleep(min(interval, max(deadline - time.monotonic(), 0.1)))
        self._servers = servers
        unanswered: dict[str, BaseException] = {
            url: RemoteServerUnavailable(f"{url} did not answer at connect")
            for url, ok in zip(servers, answered, strict=True)
            if not ok
        }
        return servers, unanswered

    async def aclose(self) -> None:
        if self._servers:
            await next(iter(self._servers.values())).http.aclose()


async def check_servers(cfg: DictConfig) -> dict[str, str]:
    """The driver's check before any shard starts: which servers answer, and which model each
    serves. Refuses when none answers, or a server does not serve the configured model."""
    servers = open_servers(cfg)
    try:
        results = await asyncio.gather(*[server.models() for server in servers.values()], return_exceptions=True)
    finally:
        await next(iter(servers.values())).http.aclose()
    answering = {
        url: models for url, models in zip(servers, results, strict=True) if not isinstance(models, BaseException)
    }
    # Each server's failure in one text naming its URL once (RemoteServerUnavailable names it already).
    down = {
        url: without_url_credentials(str(err) if isinstance(err, RemoteServerUnavailable) else f"{url}: {err}")
        for url, err in zip(servers, results, strict=True)
        if isinstance(err, BaseException)
    }
    if not answering:
        raise GenrunError(
            f"none of the {len(servers)} remote inference server(s) answered: "
            + "; ".join(down.values())
            + "; start them (docs/engines.md: External inference servers) or fix actor_rollout_ref.rollout.engine_kwargs.remote.base_urls"
        )
    for why in down.values():
        logger.warning(
            "a remote inference server does not answer (%s); it joins the rotation when its /health answers", why
        )
    wanted = remote_settings(cfg).model
    chosen = {}
    for url, models in answering.items():
        if wanted and wanted not in models:
            raise GenrunError(
                f"remote server {url} serves {models}, not engine_kwargs.remote.model={wanted!r}; set it to the served model name"
            )
        if not models:
            raise GenrunError(f"remote server {url} lists no model at /v1/models")
        chosen[url] = wanted or models[0]
    if len(set(chosen.values())) > 1:
        raise GenrunError(
            f"the remote servers serve different models ({chosen}); trajectories of one run must come from one model: "
            "list servers of the same model, or set engine_kwargs.remote.model"
        )
    return chosen
