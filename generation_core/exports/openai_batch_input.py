"""`genrun export DIR requests.jsonl --format openai-batch-input`: a run's prompts as an OpenAI
Batch API input file, so that the same requests can be sent to any server that takes one.

One line per prompt of the run's input (run.json's dataset: the files the run was planned from,
`data.train_max_samples` applied; prompts the run dropped as longer than data.max_prompt_length
included, as another server's context may hold them), in `extra_info.index` order: `custom_id`
(the batch line's own for a run over a batch file, else `index-<extra_info.index>`), `method`
"POST", `url` (the batch line's own, else `/v1/chat/completions`) and `body`: `model` (the run's
model folder name: set it to the served model's), `messages` (the prompt's chat messages as the
run's input holds them) or, for a `/v1/completions` line, `prompt`; `n` (rollout.n), `temperature`,
`top_p`, `max_tokens` (rollout.response_length), `top_k` only where the run sampled with one
(vLLM and SGLang read it; OpenAI's own API does not know it), `logprobs` true where the run kept
log-probabilities, and a batch line's own `seed`; its own temperature, top_p, top_k and max_tokens
replace the run's. A run with tools gives each line its `tools` (export_tools.py).

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
from generation_core.inputs.openai_batch import CHAT_URL, COMPLETIONS_URL
from generation_core.inputs.shard_rows import planned_rows
from generation_core.run_plan import DatasetFiles
from generation_core.store.folder import StorageFolder
from generation_core.store.run_folder import read_run_record


@dataclass
class BatchInputSummary:
    output: str
    model: str
    requests: int = 0

    def line(self) -> str:
        return (
            f"exported {self.requests} request(s) to {self.output} in the OpenAI batch input layout "
            f"(body.model is {self.model!r}, the run's model folder: set it to the model your server serves)"
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
    lines = {}
    for row in planned_rows(DatasetFiles.from_dict(record.dataset), data_options):
        info = row.get("extra_info") or {}
        if info.get("index") is None:
            raise GenrunError(
                "a row of the run's input has no extra_info.index (the sample id genrun numbers requests by): "
                f"{json.dumps(row, default=str)[:200]}"
            )
        index = int(info["index"])
        lines[index] = request_line(index, row.get(data.get("prompt_key") or "prompt"), info, config, model, tools)
    summary = BatchInputSummary(out_folder.display(out_name), model, len(lines))
    with out_folder.open_write(out_name) as sink:
        sink.write("".join(json.dumps(lines[index], ensure_ascii=False) + "\n" for index in sorted(lines)).encode())
    return summary


def request_line(
    index: int,
    prompt: Any,
    info: dict[str, Any],
    config: dict[str, Any],
    model: str,
    tools: list[dict[str, Any]] | None,
) -> dict[str, Any]:
    """One Batch API request line for a row of the run's input."""
    rollout = config["actor_rollout_ref"]["rollout"]
    url = str(info.get("url") or CHAT_URL)
    own = {key: value for key, value in (info.get("sampling_params") or {}).items() if value is not None}
    messages = _messages(prompt, index)
    body: dict[str, Any] = {"model": model}
    if url == COMPLETIONS_URL:
        # The batch reader gave a completions line's prompt to the model as one user message.
        body["prompt"] = messages[0]["content"]
    else:
        body["messages"] = messages
    body.update(
        n=int(rollout["n"]),
        temperature=float(own.get("temperature", rollout.get("temperature", 1.0))),
        top_p=float(own.get("top_p", rollout.get("top_p", 1.0))),
        max_tokens=int(own.get("max_tokens", rollout["response_length"])),
    )
    top_k = own.get("top_k", rollout.get("top_k"))
    if top_k is not None and int(top_k) > 0:
        body["top_k"] = int(top_k)
    if own.get("seed") is not None:
        body["seed"] = int(own["seed"])
    if own.get("logprobs") if "logprobs" in own else rollout.get("calculate_log_probs"):
        body["logprobs"] = True
    if tools is not None and url == CHAT_URL:
        body["tools"] = export_tools.selected_tools(tools, {"extra_info": info})
    custom_id = str(info["custom_id"]) if info.get("custom_id") is not None else f"index-{index}"
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


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
