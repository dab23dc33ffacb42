"""OpenAI Batch API input files: JSONL requests (`custom_id`, `method`, `url`, `body`) as dataset
rows in verl's chat layout, so the rest of a run reads them as any other dataset file.

A `.jsonl` (or `.json`) file of `data.train_files` is a batch file when its first request line has
a `custom_id` or a `body` (`is_batch_file`); it is then converted whole (`batch_table`, as
`dataset_files.read_json_table` reads JSON files whole) into:
- `prompt`: the chat messages (`/v1/chat/completions`: `body.messages`, text parts joined;
  `/v1/completions`: `body.prompt` as one user message, so the run's chat template applies);
- `data_source` `openai-batch`;
- `extra_info`: `index` (the 0-based line number among request lines: the sample id),
  `custom_id`, `url`, and `sampling_params`, the line's own sampling parameters (null where the
  line leaves the run's): temperature, top_p, top_k, seed, max_tokens (also from
  `max_completion_tokens`), logprobs.

The conversion is a pure function of the file's bytes, whose sha256 enters the run fingerprint
and is checked again by every shard (`check_planned`); the last conversion of a process is kept
(keyed by that digest), as a Ray worker runs shard after shard of one file.

Every line is checked before anything starts; `BatchLimits` adds the run's settings. A bad line
(not JSON, no custom_id, a repeated custom_id, an unknown url, no messages/prompt, a parameter
genrun cannot honour or that contradicts the run: `n` other than rollout.n, `max_tokens` above
rollout.response_length, logprobs without rollout.calculate_log_probs) is refused in one line that
names the first few bad lines by number.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from generation_core.config.validation import SEEDED_ENGINES
from generation_core.errors import GenrunError

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
URLS = (CHAT_URL, COMPLETIONS_URL)
DATA_SOURCE = "openai-batch"
SHOWN_PROBLEMS = 5
DETECT_LINES = 100

SAMPLING_TYPES = {"temperature": pa.float64(), "top_p": pa.float64(), "top_k": pa.int64(), "seed": pa.int64(), "max_tokens": pa.int64(), "logprobs": pa.bool_()}
SAMPLING = pa.struct([pa.field(name, kind) for name, kind in SAMPLING_TYPES.items()])
MESSAGE = pa.struct([pa.field("role", pa.string()), pa.field("content", pa.string())])
SCHEMA = pa.schema(
    [
        pa.field("data_source", pa.string()),
        pa.field("prompt", pa.list_(MESSAGE)),
        pa.field("extra_info", pa.struct([pa.field("index", pa.int64()), pa.field("custom_id", pa.string()), pa.field("url", pa.string()), pa.field("sampling_params", SAMPLING)])),
    ]
)

# Body keys read for the prompt or sampling, or without effect on what is generated.
_READ = {"messages", "prompt", "model", "n", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed", "logprobs", "stream", "user", "metadata", "store"}
# Parameters genrun's engines do not apply: accepted only at the value that changes nothing.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0),
    "stop": (None, [], ""),
    "logit_bias": (None, {}),
    "top_logprobs": (None, 0),
    "tools": (None, []),
    "tool_choice": (None, "none", "auto"),
    "parallel_tool_calls": (None, True, False),
    "response_format": (None, {"type": "text"}),
    "echo": (False,),
    "best_of": (None, 1),
    "suffix": (None, ""),
}


@dataclass(frozen=True)
class BatchLimits:
    """The run's settings a batch line must agree with."""

    n: int
    response_length: int
    calculate_log_probs: bool
    engine: str = "hf"
    """actor_rollout_ref.rollout.name: a line's seed needs an engine that honours seeds."""

    @classmethod
    def of(cls, cfg) -> BatchLimits:
        rollout = cfg.actor_rollout_ref.rollout
        return cls(int(rollout.n), int(rollout.response_length), bool(rollout.calculate_log_probs), str(rollout.name))


def is_batch_file(content: bytes) -> bool:
    """Whether a JSON/JSONL file holds OpenAI batch requests: the first of its first
    DETECT_LINES lines that parses as JSON is an object with a `custom_id` or a `body` (a
    broken first line does not hide the file's kind: its line is refused by number)."""
    for raw in content.splitlines()[:DETECT_LINES]:
        if not raw.strip():
            continue
        try:
            first = json.loads(raw)
        except ValueError:
            continue
        return isinstance(first, dict) and ("custom_id" in first or "body" in first)
    return False


_last: tuple[str, pa.Table] | None = None


def batch_table(url: str, content: bytes, limits: BatchLimits | None = None) -> pa.Table:
    """A batch file's requests as rows in verl's layout (see the module docstring); a GenrunError
    naming the bad lines. `limits`: also check each line against the run's settings."""
    global _last
    digest = hashlib.sha256(content).hexdigest()
    if limits is None and _last is not None and _last[0] == digest:
        return _last[1]
    rows: list[dict[str, Any]] = []
    problems: list[str] = []
    first_line: dict[str, int] = {}
    for number, raw in enumerate(content.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            row = _request_row(raw, number, len(rows), first_line, limits)
        except _BadLine as bad:
            problems.append(f"line {number}: {bad}")
            continue
        rows.append(row)
    if problems:
        shown = "; ".join(problems[:SHOWN_PROBLEMS]) + ("; ..." if len(problems) > SHOWN_PROBLEMS else "")
        raise GenrunError(f"OpenAI batch file {url}: {len(problems)} bad line(s): {shown}; fix or remove them")
    table = pa.Table.from_pylist(rows, schema=SCHEMA)
    _last = (digest, table)
    return table


class _BadLine(Exception):
    pass


def _request_row(raw: bytes, number: int, position: int, first_line: dict[str, int], limits: BatchLimits | None) -> dict[str, Any]:
    try:
        line = json.loads(raw)
    except ValueError:
        raise _BadLine("not JSON") from None
    if not isinstance(line, dict):
        raise _BadLine("not a JSON object")
    custom_id = line.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise _BadLine("no custom_id (each request needs a unique string custom_id)")
    if custom_id in first_line:
        raise _BadLine(f"custom_id {custom_id!r} repeats (first on line {first_line[custom_id]})")
    first_line[custom_id] = number
    url = line.get("url")
    if url not in URLS:
        raise _BadLine(f"url {url!r} is not one of {', '.join(URLS)}")
    if line.get("method", "POST") != "POST":
        raise _BadLine(f"method {line.get('method')!r}: batch requests are POST")
    body = line.get("body")
    if not isinstance(body, dict):
        raise _BadLine("no body object")
    prompt = _chat_messages(body) if url == CHAT_URL else _completion_prompt(body)
    sampling = _sampling(body, limits)
    return {"data_source": DATA_SOURCE, "prompt": prompt, "extra_info": {"index": position, "custom_id": custom_id, "url": url, "sampling_params": sampling}}


def _chat_messages(body: dict[str, Any]) -> list[dict[str, str]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _BadLine("body.messages must be a non-empty list of chat messages")
    converted = []
    for position, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise _BadLine(f"body.messages[{position}] is not a message with a role")
        if message.get("tool_calls") or message["role"] == "tool":
            raise _BadLine(f"body.messages[{position}]: tool calls in batch prompts are not supported; give text messages")
        content = message.get("content")
        if isinstance(content, list):
            kinds = {part.get("type") for part in content if isinstance(part, dict)}
            if kinds - {"text"} or len(kinds) != 1 or not all(isinstance(part, dict) for part in content):
                raise _BadLine(f"body.messages[{position}].content has non-text parts ({', '.join(sorted(map(str, kinds - {'text'})))}); only text is supported")
            content = "".join(str(part.get("text", "")) for part in content)
        if not isinstance(content, str):
            raise _BadLine(f"body.messages[{position}].content must be text")
        # The chat templates of open models know system, not OpenAI's newer developer role.
        converted.append({"role": "system" if message["role"] == "developer" else message["role"], "content": content})
    return converted


def _completion_prompt(body: dict[str, Any]) -> list[dict[str, str]]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise _BadLine("body.prompt must be one non-empty string (token-id and multi-prompt requests are not supported)")
    return [{"role": "user", "content": prompt}]


def _sampling(body: dict[str, Any], limits: BatchLimits | None) -> dict[str, Any]:
    for key, value in body.items():
        if key in _READ:
            continue
        if key not in _NEUTRAL:
            raise _BadLine(f"body.{key} is not a parameter genrun honours; remove it")
        if value not in _NEUTRAL[key]:
            raise _BadLine(f"body.{key}={json.dumps(value)} is not applied by genrun's engines; remove it")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    sampling = {
        "temperature": _number(body, "temperature", float, 0, 2),
        "top_p": _number(body, "top_p", float, 0, 1),
        "top_k": _number(body, "top_k", int, -1, None),
        "seed": _number(body, "seed", int, None, None),
        "max_tokens": None if max_tokens is None else _number({"max_tokens": max_tokens}, "max_tokens", int, 1, None),
        "logprobs": body.get("logprobs"),
    }
    if sampling["top_p"] == 0:
        raise _BadLine("body.top_p=0 keeps no token; use a value in (0, 1]")
    if sampling["logprobs"] is not None and not isinstance(sampling["logprobs"], bool):
        raise _BadLine("body.logprobs must be true or false")
    if limits is not None:
        _check_limits(body, sampling, limits)
    return sampling


def _number(body: dict[str, Any], key: str, kind: type, low: float | None, high: float | None) -> Any:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or (kind is int and not float(value).is_integer()):
        raise _BadLine(f"body.{key}={json.dumps(value)} is not {'an integer' if kind is int else 'a number'}")
    if (low is not None and value < low) or (high is not None and value > high):
        raise _BadLine(f"body.{key}={value} is outside [{low}, {'any' if high is None else high}]")
    return kind(value)


def _check_limits(body: dict[str, Any], sampling: dict[str, Any], limits: BatchLimits) -> None:
    n = body.get("n")
    if n is not None and n != limits.n:
        raise _BadLine(f"body.n={n} differs from actor_rollout_ref.rollout.n={limits.n}; set rollout.n={n} or give every line the same n")
    if sampling["max_tokens"] is not None and sampling["max_tokens"] > limits.response_length:
        raise _BadLine(
            f"max_tokens {sampling['max_tokens']} is above the run's response length {limits.response_length}; "
            f"raise data.max_response_length to at least {sampling['max_tokens']}"
        )
    if sampling["seed"] is not None and limits.engine not in SEEDED_ENGINES:
        raise _BadLine(f"body.seed: rollout.name={limits.engine} does not honour per-request seeds (these do: {', '.join(SEEDED_ENGINES)}); remove it")
    if sampling["logprobs"] and not limits.calculate_log_probs:
        raise _BadLine("body.logprobs=true needs actor_rollout_ref.rollout.calculate_log_probs=true")


def line_sampling_params(row_kwargs: dict[str, Any]) -> dict[str, Any]:
    """The sampling parameters a batch row sets for itself (none for other rows). `logprobs` stays
    the run's: every trajectory of a run has log-probabilities or none has (the merge's rule)."""
    extra_info = row_kwargs.get("extra_info")
    if not isinstance(extra_info, dict) or not isinstance(extra_info.get("sampling_params"), dict):
        return {}
    return {key: value for key, value in extra_info["sampling_params"].items() if value is not None and key != "logprobs"}
