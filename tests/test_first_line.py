"""The start of a run (issue 51 item 1): a first line before anything heavy loads, a line per task
file built, and the temporary Prefect server launched early and stopped however the start ends."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from generation_core.errors import GenrunError
from tests.conftest import REPO

pytestmark = pytest.mark.timeout(180)

# Not loaded when the first line is written: the engine stack, nor what the input checks import.
HEAVY = ("torch", "verl", "ray", "transformers", "prefect", "tensordict", "omegaconf", "hydra", "pyarrow", "fsspec")

# The first non-empty write to stderr or stdout records what the process has imported by then.
_FIRST_WRITE = """
import json, sys
seen = {}
class Watched:
    def __init__(self, stream):
        self.stream = stream
    def write(self, text):
        if text.strip() and not seen:
            seen.update(text=text, loaded=sorted({name.partition('.')[0] for name in sys.modules}))
        return self.stream.write(text)
    def __getattr__(self, name):
        return getattr(self.stream, name)
real_stdout = sys.stdout
sys.stdout, sys.stderr = Watched(sys.stdout), Watched(sys.stderr)
from flows.cli import main
code = main(sys.argv[1:])
real_stdout.write("RESULT " + json.dumps({"code": code, **seen}) + "\\n")
"""


def test_a_runs_first_line_comes_before_the_engine_stack_is_imported(tmp_path):
    """A run's first line says what happens before the first trajectory, and comes before verl,
    torch, Ray, transformers or Prefect are imported, and before what the input checks import
    (OmegaConf, Hydra, pyarrow, fsspec: seconds on a busy machine); a refused input then adds its
    one error line. Held by what is imported at the first write, not by a clock."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    env.pop("PREFECT_API_URL", None)
    arguments = ["data.train_files=/no/such/prompts.parquet", f"trainer.default_local_dir={tmp_path / 'run'}"]
    done = subprocess.run(
        [sys.executable, "-c", _FIRST_WRITE, *arguments], cwd=REPO, env=env, capture_output=True, text=True, timeout=150
    )
    [result] = [json.loads(line[len("RESULT ") :]) for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert result["code"] == 2, done.stderr
    assert (
        "starting: checking the inputs, then a temporary Prefect server and Ray, then loading the model"
        in (result["text"])
    ), result["text"]
    assert sorted(set(result["loaded"]) & set(HEAVY)) == []
    errors = [line for line in done.stderr.splitlines() if line.startswith("genrun: error:")]
    assert len(errors) == 1 and "/no/such/prompts.parquet" in errors[0], done.stderr
    assert not (tmp_path / "run").exists()


def test_a_busy_machine_is_named_in_the_first_line(monkeypatch):
    from flows.run_command import starting_line

    monkeypatch.setattr(os, "getloadavg", lambda: (9.5, 9.0, 8.0))
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setenv("PREFECT_API_URL", "http://prefect.example:4200/api")
    assert starting_line() == (
        "starting: checking the inputs, then the Prefect API at http://prefect.example:4200/api and Ray, then "
        "loading the model; the first trajectory comes after these (this machine is busy, load 9.5 on 2 CPU(s): "
        "each takes longer)"
    )


def test_building_a_task_file_says_so_with_its_rows_and_a_cached_one_does_not(tmp_path, caplog):
    from generation_core.inputs.task_build import build_tasks

    data = tmp_path / "questions.jsonl"
    data.write_text("".join(json.dumps({"question": f"q{i}"}) + "\n" for i in range(6)))
    task = {
        "loading_params": {"path": "json", "data_files": str(data)},
        "prompt_format": {"type": "template", "prompt_template": "Q: {question}"},
        "data_source": "openai/gsm8k",
    }
    settings = {"train_tasks": [task], "prompt_key": "prompt", "task_cache_dir": str(tmp_path / "cache")}
    cfg = OmegaConf.create({"data": {**settings, "storage_options": None}, "storage": {"options": {}}})
    for _ in range(2):
        with caplog.at_level(logging.INFO, logger="generation_core.inputs.task_build"):
            build_tasks(cfg)
    built = [r.getMessage() for r in caplog.records if r.name == "generation_core.inputs.task_build"]
    assert built == ["building task openai/gsm8k: 6 rows"]


@pytest.mark.parametrize("failing", ["plan_run", "start_ray"])
def test_the_temporary_prefect_server_launched_early_stops_when_the_start_fails(tmp_path, monkeypatch, failing):
    """The server launches once the light checks pass, before the tokenizer, the run's code and
    Ray: a check that refuses after it (plan_run) or a Ray that does not start leaves no server
    running, no PREFECT_API_URL behind and nothing in the run folder (issue 43 item 11 for Ray)."""
    import generation_core.preflight.preflight as preflight
    import generation_core.serving.ray_setup as ray_setup
    from flows.cli import main
    from flows.prefect_api import TemporaryPrefectServer
    from generation_core.run_plan import RunPlan, plan_shards

    launched: list[TemporaryPrefectServer] = []
    launch = TemporaryPrefectServer.launch

    def recorded() -> TemporaryPrefectServer:
        launched.append(launch())
        return launched[-1]

    def refuse(*args, **kwargs):
        raise GenrunError(f"{failing} refused")

    def plan_without_tokenizer(inputs):
        # The plan as plan_run makes it, less the tokenizer's seconds (pad id: the bundled model's).
        shards = plan_shards(inputs.dataset.files.num_rows, 1)
        return RunPlan(inputs.cfg, inputs.fingerprint, shards, 2, inputs.dataset.files)

    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    monkeypatch.setattr(TemporaryPrefectServer, "launch", staticmethod(recorded))
    monkeypatch.setattr(preflight, "plan_run", refuse if failing == "plan_run" else plan_without_tokenizer)
    monkeypatch.setattr(ray_setup, "start_ray", refuse)
    out = tmp_path / "run"
    assert main(["actor_rollout_ref.rollout.name=instant", f"trainer.default_local_dir={out}"]) == 2
    [server] = launched
    assert server.process is None and "PREFECT_API_URL" not in os.environ
    assert not out.exists() or not any(out.iterdir())


def test_a_server_that_exits_before_answering_is_one_line(monkeypatch):
    from flows import prefect_api

    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    server = prefect_api.TemporaryPrefectServer(subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"]), 9)
    with pytest.raises(GenrunError, match=r"could not start on 127.0.0.1:9 \(its output above says why\)"):
        server.wait_ready()
    server.stop()
