"""`genrun export DIR out.jsonl --format openai-batch`: a run over an OpenAI Batch API file
(inputs/openai_batch.py) written back in the Batch API's output layout.

One line per request whose owed samples are all committed, in the input file's line order: `id`,
`custom_id`, `response` (`status_code` 200, `request_id`, `body`: a `chat.completion` or
`text_completion` with `created` and one of `choices` per sample, each with `message` / `text` and
`finish_reason` ("length" where the sample was cut at its token budget, else "stop"), `logprobs`
(the sampled tokens' log-probabilities where the line asked for them; no top_logprobs), and `usage`),
`error` null. A request owes `rollout.n` samples; with adaptive sampling (generation.adaptive) a
request decided by its first `adaptive_k` samples owes those (the shard's own decision,
shard/adaptive.py's decided_prompts over its commit records) and its line has `adaptive_k` choices. Every other
request goes to the error file beside it (`<stem>_errors.jsonl`), as the Batch API's error file:
`response` null, `error` {`code`, `message`}: `generation_failed` with the failure log's error for
a sample that failed after its retries, `not_generated` for one never committed, whose message
says why: the run has not finished (some shard has no standing done record), or, in a finished
run, the prompt was dropped as longer than data.max_prompt_length.

Every field is a function of the committed trajectories and run.json (ids are digests of the
fingerprint and custom_id; `created` is the time the run took its folder, run.json's `created`),
so a run killed and resumed exports the same bytes as it would have undisturbed. Each file appears
whole or not at all; an error file left by an earlier export of the same name (replaced with
--overwrite) is removed when there is no error.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from generation_core.config.settings import GenerationSettings
from generation_core.errors import GenrunError
from generation_core.inputs.dataset_files import read_json_table
from generation_core.inputs.openai_batch import CHAT_URL
from generation_core.run_plan import DatasetFiles
from generation_core.shard.adaptive import AdaptiveRule, decided_prompts
from generation_core.store.commit_log import ShardCheckpoint, read_failure_log, read_marker
from generation_core.store.folder import StorageFolder
from generation_core.store.part_repair import committed_parts, read_verified_part
from generation_core.store.run_folder import read_run_record
from generation_core.store.run_record import RunRecord
from generation_core.store.trajectory_record import TrajectoryRecord, records_from_parquet

logger = logging.getLogger(__name__)


@dataclass
class BatchExportSummary:
    output: str
    errors_output: str
    requests: int = 0
    errors: int = 0
    decided: int = 0
    """Exported requests that adaptive sampling decided by their first adaptive_k samples."""
    adaptive_k: int | None = None

    def line(self) -> str:
        text = f"exported {self.requests} request(s) to {self.output} in the OpenAI batch output layout"
        if self.decided:
            text += f" ({self.decided} decided by their first {self.adaptive_k} samples, with that many choices)"
        return text + (
            f"; {self.errors} request(s) without all their samples in {self.errors_output}" if self.errors else ""
        )


@dataclass
class _Request:
    custom_id: str
    url: str
    prompt_tokens: int = 0
    choices: dict[int, dict[str, Any]] | None = None
    completion_tokens: int = 0


@dataclass(frozen=True)
class _RunState:
    """What a request's missing samples can be explained by."""

    n: int
    adaptive_k: int | None
    decided: set[int]
    """Prompts adaptive sampling decided by their first adaptive_k samples (shard/adaptive.py)."""
    unfinished_shards: list[str]
    shards: int
    max_prompt_length: Any
    failures: dict[int, str]

    def owed(self, index: int) -> int:
        return self.adaptive_k if self.adaptive_k is not None and index in self.decided else self.n


NOT_A_BATCH_RUN = (
    "--format openai-batch needs a run over an OpenAI batch file; use the default layout or --format openai-batch-input"
)


def check_batch_run(folder: StorageFolder, record: RunRecord) -> None:
    """Refuse, before anything is read, a run over Parquet input: it has no batch requests to answer
    (a run over JSON that is not a batch file is refused by its first trajectory, `_add_choice`)."""
    files = DatasetFiles.from_dict(record.dataset).files if record.dataset else ()
    parquet = [data_file.url for data_file in files if data_file.is_parquet]
    if parquet:
        raise GenrunError(f"{folder.display()} was generated from {parquet[0]}, a Parquet file: {NOT_A_BATCH_RUN}")


def errors_name(out_name: str) -> str:
    stem = out_name[: -len(".jsonl")] if out_name.endswith(".jsonl") else out_name
    return f"{stem}_errors.jsonl"


def export_openai_batch(
    folder: StorageFolder,
    out_folder: StorageFolder,
    out_name: str,
    tokenizer,
    eos_ids: set[int],
    data_options: dict[str, Any] | None,
) -> BatchExportSummary:
    """Write the output file and (when some request lacks samples) the error file; see the module docstring."""
    record = read_run_record(folder)
    config = record.config
    parts = committed_parts(folder)
    if not parts:
        raise GenrunError(
            f"{folder.display()} has no committed trajectories yet (no shard has committed a part); run genrun first"
        )
    requests = _input_requests(record.dataset, data_options)
    for part in parts:
        for trajectory in records_from_parquet(read_verified_part(folder, part)):
            _add_choice(requests, trajectory, tokenizer, eos_ids, folder)
    state = _run_state(folder, record)
    model = os.path.basename(str(config["actor_rollout_ref"]["model"]["path"]).rstrip("/"))
    fingerprint = record.fingerprint or ""
    created = _created(record)
    summary = BatchExportSummary(out_folder.display(out_name), out_folder.display(errors_name(out_name)))
    summary.adaptive_k = state.adaptive_k
    outputs, errors = [], []
    for index in sorted(requests):
        request = requests[index]
        request_id = hashlib.sha256(f"{fingerprint}:{request.custom_id}".encode()).hexdigest()[:32]
        choices = request.choices or {}
        owed = state.owed(index)
        if len(choices) == owed:
            outputs.append(_output_line(request, request_id, [choices[k] for k in sorted(choices)], model, created))
            summary.decided += owed != state.n
        else:
            errors.append(_error_line(request, request_id, index, owed, state))
    summary.requests, summary.errors = len(outputs), len(errors)
    with out_folder.open_write(out_name) as sink:
        sink.write("".join(outputs).encode())
    if errors:
        with out_folder.open_write(errors_name(out_name)) as sink:
            sink.write("".join(errors).encode())
    elif out_folder.exists(errors_name(out_name)):
        out_folder.remove(errors_name(out_name))
    return summary


def _input_requests(dataset: dict[str, Any] | None, data_options: dict[str, Any] | None) -> dict[int, _Request]:
    """Every request of the run's input (custom_id and url by sample id), read from the batch
    file again so that requests with nothing committed reach the error file too; empty when the
    input is not readable here (then only requests with a committed sample or a failure are known)."""
    requests: dict[int, _Request] = {}
    if not dataset:
        return requests
    files = DatasetFiles.from_dict(dataset)
    for data_file, lo, hi in files.pieces(0, files.num_rows):
        try:
            table = read_json_table(data_file.url, data_options or {}, planned=data_file).slice(lo, hi - lo)
        except GenrunError as exc:
            logger.warning(
                "the run's input %s is not readable here (%s); requests with nothing committed are left out of the error file",
                data_file.url,
                exc,
            )
            return {}
        if "extra_info" not in table.column_names:
            continue
        for info in table.column("extra_info").to_pylist():
            if info and info.get("custom_id") is not None:
                requests[int(info["index"])] = _Request(str(info["custom_id"]), str(info.get("url") or CHAT_URL))
    return requests


def _add_choice(
    requests: dict[int, _Request], trajectory: TrajectoryRecord, tokenizer, eos_ids: set[int], folder: StorageFolder
) -> None:
    info = trajectory.input_fields.get("extra_info") or {}
    if info.get("custom_id") is None:
        raise GenrunError(
            f"{folder.display()} was not generated from an OpenAI batch file (trajectory {trajectory.index}:{trajectory.rollout_n} has no "
            f"extra_info.custom_id): {NOT_A_BATCH_RUN}"
        )
    request = requests.setdefault(trajectory.index, _Request(str(info["custom_id"]), str(info.get("url") or CHAT_URL)))
    positions = [position for position, mask in enumerate(trajectory.response_mask) if mask]
    generated = [trajectory.response_ids[position] for position in positions]
    text = tokenizer.decode(generated, skip_special_tokens=True)
    finish = "stop" if trajectory.response_ids and trajectory.response_ids[-1] in eos_ids else "length"
    asked = bool((info.get("sampling_params") or {}).get("logprobs")) and trajectory.response_logprobs is not None
    values = (
        [float(trajectory.response_logprobs[position]) for position in positions]
        if asked and trajectory.response_logprobs is not None
        else None
    )
    choice: dict[str, Any] = {"index": trajectory.rollout_n}
    if request.url == CHAT_URL:
        choice.update(
            message={"role": "assistant", "content": text},
            logprobs=_chat_logprobs(tokenizer, generated, values),
            finish_reason=finish,
        )
    else:
        choice.update(text=text, logprobs=_completion_logprobs(tokenizer, generated, values), finish_reason=finish)
    request.choices = request.choices or {}
    request.choices[trajectory.rollout_n] = choice
    request.prompt_tokens = len(trajectory.prompt_ids)
    request.completion_tokens += len(generated)


def _chat_logprobs(tokenizer, tokens: list[int], values: list[float] | None) -> dict[str, Any] | None:
    """The chat layout's logprobs (no top_logprobs: genrun's engines return the sampled token's only)."""
    if values is None:
        return None
    texts = [tokenizer.decode([token]) for token in tokens]
    return {
        "content": [
            {"token": text, "logprob": value, "bytes": list(text.encode()), "top_logprobs": []}
            for text, value in zip(texts, values, strict=True)
        ]
    }


def _completion_logprobs(tokenizer, tokens: list[int], values: list[float] | None) -> dict[str, Any] | None:
    if values is None:
        return None
    texts = [tokenizer.decode([token]) for token in tokens]
    offsets = [0, *itertools.accumulate(len(text) for text in texts)][: len(texts)]
    return {"tokens": texts, "token_logprobs": values, "top_logprobs": None, "text_offset": offsets}


def _output_line(request: _Request, request_id: str, choices: list[dict[str, Any]], model: str, created: int) -> str:
    chat = request.url == CHAT_URL
    body = {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{request_id}",
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": {
            "prompt_tokens": request.prompt_tokens,
            "completion_tokens": request.completion_tokens,
            "total_tokens": request.prompt_tokens + request.completion_tokens,
        },
    }
    line = {
        "id": f"batch_req_{request_id}",
        "custom_id": request.custom_id,
        "response": {"status_code": 200, "request_id": request_id, "body": body},
        "error": None,
    }
    return json.dumps(line, ensure_ascii=False) + "\n"


def _error_line(request: _Request, request_id: str, index: int, owed: int, state: _RunState) -> str:
    got = len(request.choices or {})
    if index in state.failures:
        message = f"{owed - got} of {owed} samples failed after their retries: {state.failures[index]}"
        error = {"code": "generation_failed", "message": message}
    elif state.unfinished_shards:
        error = {
            "code": "not_generated",
            "message": f"{got} of {owed} samples committed: the run has not finished "
            f"({len(state.unfinished_shards)} of {state.shards} shard(s) not done, e.g. {state.unfinished_shards[0]}); run the same genrun command again to finish it",
        }
    elif not got:
        error = {
            "code": "not_generated",
            "message": f"the prompt is longer than data.max_prompt_length ({state.max_prompt_length} tokens): "
            "verl's overlong filter dropped it, as the run's shards recorded",
        }
    else:
        # A finished shard accounts for every sample it owed (merge.check_shard_counts): only an
        # edited folder gets here.
        message = f"{got} of {owed} samples committed in a finished run; its folder was changed after the run"
        error = {"code": "not_generated", "message": message}
    line = {"id": f"batch_req_{request_id}", "custom_id": request.custom_id, "response": None, "error": error}
    return json.dumps(line, ensure_ascii=False) + "\n"


def _run_state(folder: StorageFolder, record: RunRecord) -> _RunState:
    config = record.config
    rule = AdaptiveRule.of(GenerationSettings.of(config), record.samples_per_prompt)
    decided: set[int] = set()
    unfinished = []
    for shard in record.shards:
        checkpoint = ShardCheckpoint.load(folder, shard.name)
        if rule is not None:
            # The shard's own decision, read as its round 2 read it.
            decided |= decided_prompts(rule, folder, shard.name, checkpoint)
        if read_marker(folder, shard.name, checkpoint) is None:
            unfinished.append(shard.name)
    return _RunState(
        n=record.samples_per_prompt,
        adaptive_k=rule.k if rule is not None else None,
        decided=decided,
        unfinished_shards=unfinished,
        shards=len(record.shards),
        max_prompt_length=(config.get("data") or {}).get("max_prompt_length"),
        failures=_failures(folder, [shard.name for shard in record.shards]),
    )


def _created(record: RunRecord) -> int:
    """Unix seconds of the run's start (run.json's `created`); 0 for a run.json without one."""
    if not record.created:
        return 0
    moment = datetime.fromisoformat(record.created.replace("Z", "+00:00"))
    return int(moment.timestamp())


def _failures(folder: StorageFolder, shards: list[str]) -> dict[int, str]:
    """The last logged error of each sample id that had a failure."""
    found: dict[int, str] = {}
    for shard in shards:
        for entry in read_failure_log(folder, shard):
            if entry.get("index") is not None:
                found[int(entry["index"])] = str(entry.get("error", ""))
    return found
