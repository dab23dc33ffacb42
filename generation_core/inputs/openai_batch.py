"""OpenAI Batch API input files: JSONL requests (`custom_id`, `method`, `url`, `body`) as dataset
rows in verl's chat layout, so the rest of a run reads them as any other dataset file.

A `.jsonl` (or `.json`) file of `data.train_files` is a batch file when its first request line has
a `custom_id` or a `body` (`is_batch_file`); it is then converted whole (`batch_table`, as
`dataset_files.read_json_table` reads JSON files whole) into:
- `prompt`: the chat messages (`/v1/chat/completions`: `body.messages`, text parts joined, each
  message's `name` kept (null where it has none); `/v1/completions`: `body.prompt` as one user
  message, so the run's chat template applies);
- `images`, only in a file with `image_url` parts (`{"type": "image_url", "image_url": {"url":
  ...}}`: a `data:image/...;base64,` URL, a local path, `file://` or a URL fsspec reads), for a
  vision-language model: each line's images read into `{"bytes": ...}` cells, in order, each part
  an `<image>` in its message's text (verl's layout, docs/multimodal.md); a text-only model, an
  image that does not read or open, or `<image>` in a line's own text beside its parts is refused;
- `data_source` `openai-batch`;
- `extra_info`: `index` (the sample id: the file's first dataset row, `first_row`, plus the
  0-based position among its request lines, so the files of one run number their requests one
  after another), `custom_id`, `url`, and `sampling_params`, the line's own sampling parameters
  (null where the line leaves the run's): temperature, top_p, top_k, seed, max_tokens (also from
  `max_completion_tokens`), logprobs.

The conversion is a pure function of the file's bytes, whose sha256 enters the run fingerprint
and is checked again by every shard (`check_planned`); the last conversion of a process is kept
(keyed by that digest and `first_row`), as a Ray worker runs shard after shard of one file.

Every line is checked before anything starts; `BatchLimits` adds the run's settings. A bad line
(not JSON, no custom_id, a custom_id repeated in this file or an earlier one of the run, an
unknown url, no messages/prompt, a role a chat template cannot render, text holding a lone
surrogate escape, a parameter genrun cannot honour or that contradicts the run: `n` other than
rollout.n, `max_tokens` above rollout.response_length, logprobs without
rollout.calculate_log_probs) is refused in one line that names the first few bad lines by number
and custom_id.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from generation_core.config.validation import SEEDED_ENGINES
from generation_core.errors import GenrunError
from generation_core.inputs.batch_images import IMAGES, BadImage, message_images, placeholder_problem
from generation_core.inputs.chat_content import BadMessage, prompt_message
from generation_core.inputs.images import IMAGE_COLUMN

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
URLS = (CHAT_URL, COMPLETIONS_URL)
DATA_SOURCE = "openai-batch"
SHOWN_PROBLEMS = 5
DETECT_LINES = 100

SAMPLING_TYPES = {
    "temperature": pa.float64(),
    "top_p": pa.float64(),
    "top_k": pa.int64(),
    "seed": pa.int64(),
    "max_tokens": pa.int64(),
    "logprobs": pa.bool_(),
}
SAMPLING = pa.struct([pa.field(name, kind) for name, kind in SAMPLING_TYPES.items()])
MESSAGE = pa.struct([pa.field("role", pa.string()), pa.field("content", pa.string()), pa.field("name", pa.string())])
SCHEMA = pa.schema(
    [
        pa.field("data_source", pa.string()),
        pa.field("prompt", pa.list_(MESSAGE)),
        pa.field(
            "extra_info",
            pa.struct(
                [
                    pa.field("index", pa.int64()),
                    pa.field("custom_id", pa.string()),
                    pa.field("url", pa.string()),
                    pa.field("sampling_params", SAMPLING),
                ]
            ),
        ),
    ]
)

# Body keys read for the prompt or sampling, or without effect on what is generated.
_READ = {
    "messages",
    "prompt",
    "model",
    "n",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "logprobs",
    "stream",
    "user",
    "metadata",
    "store",
}
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
    model: str | None = None
    """actor_rollout_ref.model.path: image parts need a vision-language model (`text_only_kind`)."""

    @classmethod
    def of(cls, cfg) -> BatchLimits:
        rollout = cfg.actor_rollout_ref.rollout
        return cls(
            int(rollout.n),
            int(rollout.response_length),
            bool(rollout.calculate_log_probs),
            str(rollout.name),
            str(cfg.actor_rollout_ref.model.path),
        )


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


_last: tuple[str, int, pa.Table] | None = None

FirstSeen = dict[str, tuple[str, int]]
"""custom_id -> (file URL, line number) where it first appears among the run's batch files."""


def batch_table(
    url: str, content: bytes, limits: BatchLimits | None = None, first_row: int = 0, seen: FirstSeen | None = None
) -> pa.Table:
    """A batch file's requests as rows in verl's layout (see the module docstring); a GenrunError
    naming the bad lines. `limits`: also check each line against the run's settings. `first_row`:
    the index of the first request. `seen`: the custom_ids of the run's earlier batch files
    (extended with this file's), which this file must not repeat."""
    global _last
    digest = hashlib.sha256(content).hexdigest()
    if limits is None and seen is None and _last is not None and _last[:2] == (digest, first_row):
        return _last[2]
    seen = {} if seen is None else seen
    rows: list[dict[str, Any]] = []
    problems: list[str] = []
    for number, raw in enumerate(content.splitlines(), start=1):
        if not raw.strip():
            continue
        custom_id = None
        try:
            line = _parse(raw)
            custom_id = _claim_custom_id(line, url, number, seen)
            rows.append(_request_row(line, custom_id, first_row + len(rows), limits))
        except _BadLine as bad:
            problems.append(f"line {number}{'' if custom_id is None else f' (custom_id {custom_id!r})'}: {bad}")
    if problems:
        shown = "; ".join(problems[:SHOWN_PROBLEMS]) + ("; ..." if len(problems) > SHOWN_PROBLEMS else "")
        # A key or value quoted from the line may hold a lone surrogate: escaped, so the line prints.
        shown = shown.encode("utf-8", "backslashreplace").decode("utf-8")
        raise GenrunError(f"OpenAI batch file {url}: {len(problems)} bad line(s): {shown}; fix or remove them")
    with_images = any(row["images"] for row in rows)
    for row in rows:
        if not with_images:
            del row["images"]
    table = pa.Table.from_pylist(rows, schema=SCHEMA.append(pa.field(IMAGE_COLUMN, IMAGES)) if with_images else SCHEMA)
    _last = (digest, first_row, table)
    return table


class _BadLine(Exception):
    pass


def _parse(raw: bytes) -> dict[str, Any]:
    try:
        line = json.loads(raw)
    except ValueError:
        raise _BadLine("not JSON") from None
    if not isinstance(line, dict):
        raise _BadLine("not a JSON object")
    return line


def _claim_custom_id(line: dict[str, Any], url: str, number: int, seen: FirstSeen) -> str:
    """The line's custom_id, refused when it is missing or repeats one of this file or an earlier
    file of the run (the export names each request by it)."""
    custom_id = line.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise _BadLine("no custom_id (each request needs a unique string custom_id)")
    _text(custom_id, "custom_id")
    if custom_id in seen:
        first_url, first_number = seen[custom_id]
        if (first_url, first_number) == (url, number):
            raise _BadLine(f"custom_id {custom_id!r}: this file is listed twice in data.train_files; list it once")
        if first_url == url:
            raise _BadLine(f"custom_id {custom_id!r} repeats (first on line {first_number})")
        raise _BadLine(
            f"custom_id {custom_id!r} repeats (first in {first_url} line {first_number}); "
            "custom_ids must be unique across the run's batch files"
        )
    seen[custom_id] = (url, number)
    return custom_id


def _text(value: str, where: str) -> str:
    """`value`, refused when it holds a lone UTF-16 surrogate: JSON can escape one (`\\ud800`), but
    it encodes no character, so neither Arrow nor a tokenizer can take it."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as bad:
        raise _BadLine(
            f"{where} holds a lone surrogate escape (\\u{ord(value[bad.start]):04x}), which is no character; "
            "write the character itself or its full surrogate pair"
        ) from None
    return value


def _request_row(line: dict[str, Any], custom_id: str, index: int, limits: BatchLimits | None) -> dict[str, Any]:
    url = line.get("url")
    if url not in URLS:
        raise _BadLine(f"url {url!r} is not one of {', '.join(URLS)}")
    if line.get("method", "POST") != "POST":
        raise _BadLine(f"method {line.get('method')!r}: batch requests are POST")
    body = line.get("body")
    if not isinstance(body, dict):
        raise _BadLine("no body object")
    images: list[dict[str, bytes]] = []
    prompt = _chat_messages(body, images, limits) if url == CHAT_URL else _completion_prompt(body)
    problem = placeholder_problem(prompt, len(images))
    if problem is not None:
        raise _BadLine(problem)
    sampling = _sampling(body, limits)
    info = {"index": index, "custom_id": custom_id, "url": url, "sampling_params": sampling}
    return {"data_source": DATA_SOURCE, "prompt": prompt, "extra_info": info, "images": images}


def _chat_messages(
    body: dict[str, Any], images: list[dict[str, bytes]], limits: BatchLimits | None
) -> list[dict[str, str | None]]:
    """The line's messages in verl's layout; its `image_url` parts' images appended to `images`."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _BadLine("body.messages must be a non-empty list of chat messages")
    converted = []
    for position, message in enumerate(messages):
        where = f"body.messages[{position}]"
        try:
            # One rule with the tasks' chat_messages (inputs/chat_content.py): the roles a chat
            # template renders, text content (image_url parts as verl's `<image>`), `name` kept,
            # no tool calls.
            built = prompt_message(message, ("image_url",))
        except BadMessage as bad:
            raise _BadLine(f"{where}{bad}") from None
        try:
            images.extend(message_images(message, where, None if limits is None else limits.model))
        except BadImage as bad:
            raise _BadLine(str(bad)) from None
        name = built.get("name")
        converted.append(
            {
                "role": built["role"],
                "content": _text(built["content"], f"{where}.content"),
                "name": None if name is None else _text(name, f"{where}.name"),
            }
        )
    return converted


def _completion_prompt(body: dict[str, Any]) -> list[dict[str, str | None]]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise _BadLine(
            "body.prompt must be one non-empty string (token-id and multi-prompt requests are not supported)"
        )
    return [{"role": "user", "content": _text(prompt, "body.prompt"), "name": None}]


def _sampling(body: dict[str, Any], limits: BatchLimits | None) -> dict[str, Any]:
    for key, value in body.items():
        if key in _READ:
            continue
        if key not in _NEUTRAL:
            raise _BadLine(f"body.{key} is not a parameter genrun honours; remove it")
        if value not in _NEUTRAL[key]:
            raise _BadLine(f"body.{key}={json.dumps(value)} is not applied by genrun's engines; remove it")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    _number(body, "n", int, 1, None)
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


INT64 = (-(1 << 63), (1 << 63) - 1)
"""The range every integer parameter must lie in: the rows' Arrow type (int64), beyond which no
engine takes it either."""


def _number(body: dict[str, Any], key: str, kind: type, low: float | None, high: float | None) -> Any:
    """body[key] (None when absent) checked to be a `kind` in [low, high] (None: no bound but an
    int64's); a _BadLine saying which bound it misses."""
    value = body.get(key)
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or math.isnan(value)
        or (kind is int and not float(value).is_integer())
    ):
        raise _BadLine(f"body.{key}={json.dumps(value)} is not {'an integer' if kind is int else 'a number'}")
    if low is not None and high is not None and not low <= value <= high:
        raise _BadLine(f"body.{key}={value} is outside [{low}, {high}]")
    if low is not None and value < low:
        raise _BadLine(f"body.{key}={value} must be >= {low}")
    if kind is int and not INT64[0] <= value <= INT64[1]:
        raise _BadLine(f"body.{key}={value} is beyond a 64-bit integer's range [{INT64[0]}, {INT64[1]}]")
    return kind(value)


def _check_limits(body: dict[str, Any], sampling: dict[str, Any], limits: BatchLimits) -> None:
    n = body.get("n")
    if n is not None and n != limits.n:
        raise _BadLine(
            f"body.n={n} differs from actor_rollout_ref.rollout.n={limits.n}; set rollout.n={n} or give every line the same n"
        )
    if sampling["max_tokens"] is not None and sampling["max_tokens"] > limits.response_length:
        raise _BadLine(
            f"max_tokens {sampling['max_tokens']} is above the run's response length {limits.response_length}; "
            f"raise data.max_response_length to at least {sampling['max_tokens']}"
        )
    if sampling["seed"] is not None and limits.engine not in SEEDED_ENGINES:
        raise _BadLine(
            f"body.seed: rollout.name={limits.engine} does not honour per-request seeds (these do: {', '.join(SEEDED_ENGINES)}); remove it"
        )
    if sampling["logprobs"] and not limits.calculate_log_probs:
        raise _BadLine("body.logprobs=true needs actor_rollout_ref.rollout.calculate_log_probs=true")


def line_sampling_params(row_kwargs: dict[str, Any]) -> dict[str, Any]:
    """The sampling parameters a batch row sets for itself (none for other rows). `logprobs` stays
    the run's: every trajectory of a run has log-probabilities or none has (the merge's rule)."""
    extra_info = row_kwargs.get("extra_info")
    if not isinstance(extra_info, dict) or not isinstance(extra_info.get("sampling_params"), dict):
        return {}
    return {
        key: value for key, value in extra_info["sampling_params"].items() if value is not None and key != "logprobs"
    }
