"""`genrun bench`: the engine's own benchmark and a whole genrun run on the same prompts and
lengths, per sitting (hf here; remote in test_remote_vllm.py; sglang and vllm need GPUs)."""

from __future__ import annotations

import json
import os

import pytest

from tests.conftest import run_genrun

pytestmark = pytest.mark.timeout(400)


def test_bench_runs_both_sides_on_the_same_tokens_and_reports_the_ratio(tmp_path, prompts_file):
    out = tmp_path / "bench.json"
    # Prompts from the user's dataset (12 rows; the first 6 taken), rollout.n from the overrides.
    result = run_genrun(["bench", "--sittings", "1", "--prompts", "6", "--tokens", "5", "--json", str(out),
                         f"data.train_files={prompts_file}", "actor_rollout_ref.rollout.n=2"], timeout=360)
    assert result.returncode == 0, result.stderr[-3000:]
    bench = json.loads(out.read_text())
    assert (bench["engine"], bench["requests"], bench["tokens"]) == ("hf", 12, 5)
    [sitting] = bench["sittings"]
    # Every response has exactly --tokens tokens on both sides: the same work, timed twice.
    assert sitting["engine_tokens"] == sitting["genrun_tokens"] == 12 * 5
    assert sitting["engine_seconds"] > 0 and sitting["genrun_generation_seconds"] > 0
    assert sitting["genrun_wall_seconds"] > sitting["genrun_generation_seconds"]
    assert sitting["ratio"] == pytest.approx(sitting["genrun_tokens_per_s"] / sitting["engine_tokens_per_s"], rel=1e-3)
    assert bench["ratio"]["min"] <= bench["ratio"]["median"] <= bench["ratio"]["max"]
    assert "genrun/engine: median" in result.stdout and "sitting 1: engine" in result.stdout
    scratch = result.stdout.split("scratch: ")[1].split()[0]
    assert not os.path.exists(scratch), "the scratch folder (prompts, the run's folder) is removed once the JSON is written"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--sittings", "0"], "--sittings must be an integer >= 1"),
        (["--tokens", "many"], "usage: genrun bench"),
        (["--frobnicate"], "unknown option --frobnicate"),
        (["data.max_response_length=9"], "data.max_response_length is set by the bench (--tokens"),
        (["actor_rollout_ref.rollout.name=instant"], "no engine-side benchmark for rollout.name=instant"),
    ],
)
def test_bad_bench_arguments_are_one_line_before_anything_starts(args, message, capsys):
    from flows.cli import main

    assert main(["bench", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("genrun: error:")
