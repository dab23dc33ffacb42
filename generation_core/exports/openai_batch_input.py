"""`genrun export DIR requests.jsonl --format openai-batch-input`: a run's prompts as an OpenAI
Batch API input file, so that the same requests can be sent to any server that takes one.

One line per prompt of the run's input (run.json's dataset: the files the run was planned from,
`data.train_max_samples` applied; prompts the run dropped as longer than data.max_prompt_length
included, as another server's context may hold them), in `extra_info.index` order.

A run over OpenAI batch files gives each request back as its file holds it (its `developer`
messages, `max_completion_tokens`, its own `logprobs` or none, its `model`), with the run's
sampling added only for the parameters it left out (`n` above all: the samples the run drew) and
the run's tools on a chat line: a round trip changes nothing a request set. The reader turned some of it
into what a chat template and genrun's engines take (developer -> system, one max_tokens), which
is not what the request said.

Any other run's prompts become new requests: `custom_id` `index-<extra_info.index>`, `method`
"POST", `url` `/v1/chat/completions` and `body`: `model` (the run's model folder name: set it to
the served model's), `messages` (the prompt's chat messages as the run's input holds them), the
run's sampling (`run_sampling`) and `logprobs` true where the run kept log-probabilities. A run
with tools gives each line its `tools` (export_tools.py).

Nothing here needs the run's trajectories or tokenizer: a run that has not started yet exports
the same file.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from generation_core.errors import GenrunError
from generation_core.exports import export_tools
from generation_core.inputs.dataset_location import open_input, storage_errors
from generation_core.inputs.openai_batch import CHAT_URL, is_batch_file
from generation_core.inputs.shard_rows import planned_rows
from generation_core.run_plan import DatasetFiles
from generation_core.store.folder import StorageFolder
from generation_core.store.run_folder import read_run_record


@dataclass
class BatchInputSummary:
    output: str
    model: str
    requests: int = 0
    kept: int = 0
    """Requests given back as the run's batch files hold them."""

    def line(self) -> str:
        text = f"exported {self.requests} request(s) to {self.output} in the OpenAI batch input layout "
        if self.kept == self.requests:
            return text + "(each as the run's batch file holds it; the run's sampling added where it set none)"
        kept = f"; {self.kept} as the run's batch files hold them" if self.kept else ""
        return text + (
            f"(body.model is {self.model!r}, the run's model folder: set it to the model your server serves{kept})"
        )


def export_openai_batch_input(
    folder: StorageFolder, out_folder: StorageFolder, out_name: str, trust_remote_code: bool = False
) -> BatchInputSummary:
    """Write the input layout (see the module docstring)."""
    record = read_run_record(folder)
    config = record.config
    if not record.dataset:
        raise GenrunError(
            f"{folder.display()}/run.json names no input files (a run.json of an earlier genrun); nothing written"
        )
    model = os.path.basename(str(config["actor_rollout_ref"]["model"]["path"]).rstrip("/"))
    tools = export_tools.run_tool_schemas(config, trust_remote_code)
    data = config.get("data") or {}
    data_options = data.get("storage_options") or folder.storage_options
    dataset = DatasetFiles.from_dict(record.dataset)
    originals = batch_requests(dataset, data_options)
    lines = {}
    kept = 0
    for row in planned_rows(dataset, data_options):
        info = row.get("extra_info") or {}
        if info.get("index") is None:
            raise GenrunError(
                "a row of the run's input has no extra_info.index (the sample id genrun numbers requests by): "
                f"{json.dumps(row, default=str)[:200]}"
            )
        index = int(info["index"])
        original = originals.get(str(info.get("custom_id")))
        if original is not None:
            kept += 1
            lines[index] = kept_request(original, info, config, tools)
        else:
            lines[index] = request_line(index, row.get(data.get("prompt_key") or "prompt"), config, model, tools)
    summary = BatchInputSummary(out_folder.display(out_name), model, len(lines), kept)
    with out_folder.open_write(out_name) as sink:
        sink.write("".join(json.dumps(lines[index], ensure_ascii=False) + "\n" for index in sorted(lines)).encode())
    return summary


def run_sampling(rollout: dict[str, Any]) -> dict[str, Any]:
    """The sampling the run applied where a request set none of its own: `n` (rollout.n),
    `temperature`, `top_p`, `max_tokens` (rollout.response_length), `top_k` only where the run
    sampled with one (vLLM and SGLang read it; OpenAI's own API does not know it)."""
    sampling: dict[str, Any] = {
        "n": int(rollout["n"]),
        "temperature": float(rollout.get("temperature", 1.0)),
        "top_p": float(rollout.get("top_p", 1.0)),
        "max_tokens": int(rollout["response_length"]),
    }
    top_k = rollout.get("top_k")
    if top_k is not None and int(top_k) > 0:
        sampling["top_k"] = int(top_k)
    return sampling


def request_line(
    index: int, prompt: Any, config: dict[str, Any], model: str, tools: list[dict[str, Any]] | None
) -> dict[str, Any]:
    """A new Batch API request line for a row of the run's input that is no batch file's."""
    rollout = config["actor_rollout_ref"]["rollout"]
    body: dict[str, Any] = {"model": model, "messages": _messages(prompt, index), **run_sampling(rollout)}
    if rollout.get("calculate_log_probs"):
        body["logprobs"] = True
    if tools is not None:
        body["tools"] = export_tools.selected_tools(tools, {"extra_info": {"index": index}})
    return {"custom_id": f"index-{index}", "method": "POST", "url": CHAT_URL, "body": body}


def kept_request(
    original: dict[str, Any], info: dict[str, Any], config: dict[str, Any], tools: list[dict[str, Any]] | None
) -> dict[str, Any]:
    """A batch file's request as the file holds it, plus the run's sampling for the parameters it
    left out (run_sampling: above all `n`, the samples the run drew of it) and, on a chat line of a
    run with tools, the tools the model was offered. Nothing it set is changed or added to."""
    line = json.loads(json.dumps(original))
    body = line["body"]
    for key, value in run_sampling(config["actor_rollout_ref"]["rollout"]).items():
        if key != "max_tokens" or "max_completion_tokens" not in body:
            body.setdefault(key, value)
    if tools is not None and line.get("url") == CHAT_URL:
        body.setdefault("tools", export_tools.selected_tools(tools, {"extra_info": info}))
    return line


def batch_requests(dataset: DatasetFiles, options: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """custom_id -> the request as the run's OpenAI batch files hold it (none for other files).
    The run read these files whole already (custom_ids are unique across them)."""
    requests: dict[str, dict[str, Any]] = {}
    for file in dataset.files:
        if not file.url.endswith((".json", ".jsonl")):
            continue
        with storage_errors(file.url), open_input(file.url, options) as handle:
            content = handle.read()
        if not is_batch_file(content):
            continue
        for raw in content.splitlines():
            if raw.strip():
                line = json.loads(raw)
                requests[str(line["custom_id"])] = line
    return requests


def _messages(prompt: Any, index: int) -> list[dict[str, Any]]:
    """The prompt's chat messages with their keys as the input holds them (null keys dropped:
    columnar input gives every message every key)."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if not isinstance(prompt, list) or not prompt:
        raise GenrunError(
            f"the prompt of row {index} of the run's input is not a list of chat messages: "
            f"{json.dumps(prompt, default=str)[:200]}"
        )
    return [{key: value for key, value in dict(message).items() if value is not None} for message in prompt]
