"""Refusals that answer before the engine stack imports (audit 2026-11-28 #15 and #18, newcomer
2026-11-28 item 6): an unknown engine name, verl's TensorRT-LLM engine, a model path that is a
file, an output folder under a file and a missing S3 bucket are refused by `check_inputs` and the
start of `plan_run` while torch, verl and Ray are not imported (about 10 s of CPU each refusal
used to spend importing them), GPUs this machine lacks with Ray's import only, and the output
folder is never made."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import chat_rows, write_parquet

pytestmark = pytest.mark.timeout(300)

REPO = Path(__file__).resolve().parent.parent

# Runs in a fresh interpreter: each case through check_inputs and plan_run, as `genrun` calls them;
# prints one JSON line per case: its refusal and the heavy modules imported by then.
SCRIPT = """
import json, sys
from generation_core.errors import GenrunError
from generation_core.preflight.preflight import check_inputs, plan_run
for overrides in json.loads(sys.argv[1]):
    try:
        plan_run(check_inputs(overrides))
        refusal = None
    except GenrunError as exc:
        refusal = str(exc)
    heavy = sorted(m for m in ("torch", "verl", "ray", "transformers") if m in sys.modules)
    print("CASE " + json.dumps({"refusal": refusal, "heavy": heavy}), flush=True)
"""


def test_cheap_refusals_come_before_the_engine_stack_imports(tmp_path, model_dir, s3_server):
    prompts = write_parquet(tmp_path / "p.parquet", chat_rows(2))
    a_file = tmp_path / "a_file"
    a_file.write_text("not a folder")
    base = [f"data.train_files={prompts}", "actor_rollout_ref.rollout.name=instant"]
    out = f"trainer.default_local_dir={tmp_path / 'out'}"
    cases = [
        ([*base[:1], "actor_rollout_ref.rollout.name=foo", out], "unknown actor_rollout_ref.rollout.name='foo'; "),
        (
            [*base[:1], "actor_rollout_ref.rollout.name=trtllm", out],
            "actor_rollout_ref.rollout.name='trtllm' is verl's TensorRT-LLM replica, which genrun does not run ",
        ),
        (
            [*base, f"actor_rollout_ref.model.path={prompts}", out],
            f"model path {prompts} is a file, not a model directory",
        ),
        ([*base, f"trainer.default_local_dir={a_file / 'out'}"], f"cannot create output folder {a_file / 'out'}: "),
        (
            [*base, "trainer.default_local_dir=s3://no-such-bucket-genrun/run"],
            "bucket 'no-such-bucket-genrun' does not exist",
        ),
        # Audit #14: GPUs this machine lacks, where the run would start Ray: Ray's count, not the engine stack.
        (
            [*base[:1], "trainer.device=cuda", "+ray_kwargs.ray_init.num_gpus=0", out],
            "need 1 GPU(s) but this machine (ray_kwargs.ray_init.address is unset: the run starts Ray here) has 0",
        ),
    ]
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, json.dumps([overrides for overrides, _ in cases])],
        cwd=REPO,
        env={**os.environ, **s3_server},
        capture_output=True,
        text=True,
        timeout=240,
    )
    results = [json.loads(line[5:]) for line in done.stdout.splitlines() if line.startswith("CASE ")]
    assert len(results) == len(cases), done.stdout[-2000:] + done.stderr[-3000:]
    for (overrides, message), result in zip(cases, results, strict=True):
        assert result["refusal"] is not None and message in result["refusal"], (overrides, result)
        assert result["heavy"] == (["ray"] if "trainer.device=cuda" in overrides else []), (overrides, result)
    # The engine list genrun offers never names an engine it does not run.
    assert (
        "trtllm" not in results[0]["refusal"]
        and "known engines: hf, instant, remote, sglang, vllm" in results[0]["refusal"]
    )
    assert not (tmp_path / "out").exists() and a_file.read_text() == "not a folder"


def test_a_remote_server_that_does_not_answer_is_named_once():
    """Newcomer 2026-11-28 item 6: the remote refusal printed the URL twice
    ("http://127.0.0.1:9: http://127.0.0.1:9: ConnectError ...")."""
    import asyncio

    from generation_core.config.loading import load_config
    from generation_core.engines.remote import check_servers
    from generation_core.errors import GenrunError

    cfg = load_config(
        [
            "actor_rollout_ref.rollout.name=remote",
            "actor_rollout_ref.rollout.engine_kwargs.remote.base_urls=[http://127.0.0.1:9]",
        ]
    )
    with pytest.raises(GenrunError) as refused:
        asyncio.run(check_servers(cfg))
    message = str(refused.value)
    assert message.startswith("none of the 1 remote inference server(s) answered: http://127.0.0.1:9: Connect"), message
    assert message.count("127.0.0.1:9") == 1, message
