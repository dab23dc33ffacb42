"""Issue 44 item 9: every script kept in bench/ runs here in its seconds-long `--smoke` mode (tiny
sizes; genrun's own input checks in place of a whole run, whose Prefect and Ray start take a
minute), so none rots unseen; the figures themselves are in bench/RESULTS.md. Scripts that need a
GPU answer --help; the GPU kit's shell scripts are parsed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "bench"
# Modules the scripts import, not scripts: the simulated engine (bench/sim), genrun's CLI with it
# registered (sim/genrun.py, what gpu_rate.py's runs start), the helper that runs genrun as a user
# does and the one that reads its processes by role.
NOT_SCRIPTS = {
    "__init__.py",
    "genrun_process.py",
    "process_roles.py",
    "sim/__init__.py",
    "sim/engine.py",
    "sim/replica.py",
    "sim/genrun.py",
}
# Scripts that import torch, transformers or verl: one process runs all their smoke modes, one
# after another, so those imports (seconds of CPU each) are paid once.
HEAVY = [
    "merge_memory.py",
    "engine_streaming.py",
    "scale.py",
    "scheduling.py",
    "sim/gpu_rate.py",
]
LIGHT = {
    "startup.py": ["--smoke"],
    "cpu_per_trajectory.py": ["--smoke"],
    "status_many_shards.py": ["--smoke"],
    "ledger_memory.py": ["--smoke"],
    "gpu/sglang_offline.py": ["--make-prompts", "{tmp}/prompts.parquet", "--repeat", "2"],
    "gpu/build_model.py": ["--help"],
    "gpu/kit/prepare.py": ["--help"],
    "gpu/kit/install_part.py": ["--help"],
    "gpu/kit/show_output.py": ["--help"],
    "gpu/kit/import_trace.py": ["{tmp}", "json,pyarrow"],
    "gpu/kit/sitting.sh": ["-n"],  # bash -n: parsed, not run (it needs the GPU machine)
    "gpu/kit/receive.sh": ["-n"],
    "gpu/kit/rehearse.sh": ["-n"],
}
# Runs each script as `python SCRIPT --smoke` would (its folder first on sys.path, __main__),
# and says which one failed.
RUNNER = """
import json, os, runpy, sys, time
for script in json.loads(sys.argv[1]):
    sys.argv = [script, "--smoke"]
    sys.path.insert(0, os.path.dirname(script))
    started = time.process_time()
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
        if stop.code not in (None, 0):
            raise SystemExit(f"{script} --smoke exited: {stop.code}")
    print(f"### {script} --smoke passed ({time.process_time() - started:.1f} s CPU)", flush=True)
"""


def _run(command: list[str]) -> None:
    done = subprocess.run(command, cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True, text=True)
    assert done.returncode == 0, f"{command} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"


@pytest.mark.timeout(240)
def test_the_scripts_that_load_torch_run_their_smoke_modes():
    _run([sys.executable, "-c", RUNNER, json.dumps([str(BENCH / script) for script in HEAVY])])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("script", sorted(LIGHT))
def test_a_light_script_runs_its_smoke_mode(script, tmp_path):
    arguments = [argument.format(tmp=tmp_path) for argument in LIGHT[script]]
    if script.endswith(".sh"):
        _run(["bash", *arguments, str(BENCH / script)])
    else:
        _run([sys.executable, str(BENCH / script), *arguments])


@pytest.mark.timeout(10)
def test_every_bench_script_is_smoked_here():
    scripts = {
        str(path.relative_to(BENCH))
        for pattern in ("*.py", "*.sh")
        for path in BENCH.rglob(pattern)
        if "__pycache__" not in path.parts
    }
    unsmoked = scripts - NOT_SCRIPTS - set(HEAVY) - set(LIGHT)
    assert not unsmoked, f"bench scripts without a smoke run here (add them to HEAVY or LIGHT): {sorted(unsmoked)}"
    assert set(HEAVY) | set(LIGHT) <= scripts, "a script named here is no longer in bench/"
