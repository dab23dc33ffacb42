"""Every command block of README.md runs (issue 45 item 10), so a README step that fails fails CI.

Each shell command of a ```bash block is either run, the way a newcomer types it after `make
demo` (generation on the instant engine: the same command path, Prefect and Ray, without the
CPU model's minutes; the README's `outputs/genrun/gen-...` is a folder such a run wrote), or named
in NOT_RUN_HERE with the reason. A command this file does not know fails the test: a new README
step gets a way to run here, or a reason it cannot.
"""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO, run_genrun

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

README = REPO / "README.md"
RUN_FOLDER = "outputs/genrun/gen-..."
INSTANT = "actor_rollout_ref.rollout.name=instant"

NOT_RUN_HERE = {
    "make test": "CI's own command (.ci/run): this test runs inside it",
    "make demo   #": "make setup, then `genrun` on the bundled defaults: the next block's `.venv/bin/genrun` runs here (instant engine)",
    "python3.11 -m venv .venv && .venv/bin/pip install -e '.[sglang]'": "SGLang needs a GPU (it pins a CUDA torch)",
    ".venv/bin/genrun actor_rollout_ref.rollout.name=sglang": "needs GPUs (trainer.n_gpus_per_node=8)",
    ".venv/bin/genrun actor_rollout_ref.rollout.name=remote": "needs inference servers at the addresses it names",
}
PLACEHOLDER_PATHS = ("/data/", "/models/")


def readme_commands() -> list[tuple[int, str]]:
    """(block number, command) for each command of README.md's ```bash blocks, continuation
    lines joined, comments kept (NOT_RUN_HERE matches on the text as written)."""
    blocks = re.findall(r"^```bash\n(.*?)^```", README.read_text(), re.S | re.M)
    commands = []
    for number, block in enumerate(blocks, start=1):
        for command in re.sub(r"\\\n\s*", " ", block).splitlines():
            if command.strip():
                commands.append((number, command.strip()))
    return commands


def _not_run_reason(command: str) -> str | None:
    return next((reason for prefix, reason in NOT_RUN_HERE.items() if command.startswith(prefix)), None)


@pytest.fixture(scope="module")
def runs(prefect_server, ray_local, tmp_path_factory):
    """The folders the README's later commands read: the bundled defaults' run (block 2's first
    command, as `make demo` runs it) and the tool-calling example's run with 4 samples per prompt,
    which has rewards (what block 6 says it needs). That one runs the example's arguments in this
    process (`run_in_process`: the same preflight and driver, the CLI path being the demo run's),
    which spares a second start of genrun (CI's time budget)."""
    from generation_core.driver.in_process import run_in_process
    from generation_core.preflight.preflight import preflight

    tmp = tmp_path_factory.mktemp("readme")
    demo = tmp / "demo"
    done = run_genrun([INSTANT, f"trainer.default_local_dir={demo}"], env=prefect_server.env)
    assert done.returncode == 0, done.stderr[-3000:]
    tools = tmp / "tools"
    example = (REPO / "examples" / "tool_calling" / "README.md").read_text()
    command = shlex.split(re.sub(r"\\\n\s*", " ", re.search(r"```bash\n(.*?)```", example, re.S).group(1)))
    assert command[0] == ".venv/bin/genrun", command
    run_in_process(
        preflight(
            [
                *command[1:],
                "actor_rollout_ref.rollout.n=4",
                INSTANT,
                "data.train_max_samples=6",
                f"trainer.default_local_dir={tools}",
                "generation.show_progress=false",
            ]
        )
    )
    assert (tools / "trajectories.pkl").exists()
    return {"demo": demo, "tools": tools, "tmp": tmp}


def test_every_readme_command_is_run_here_or_says_why_not(runs, prefect_server):
    commands = readme_commands()
    assert len(commands) >= 10, commands
    ran, unknown = [], []
    for block, command in commands:
        if _not_run_reason(command):
            continue
        arguments = shlex.split(command, comments=True)
        if arguments[:2] == ["make", "demo"]:
            _run_make_demo(arguments[2:], runs["tmp"], prefect_server.env)
        elif arguments == [".venv/bin/genrun"]:
            # The bundled defaults: the `runs` fixture ran exactly this (instant engine) for the demo folder.
            assert (runs["demo"] / "trajectories.pkl").exists()
        elif arguments[0] == ".venv/bin/genrun" and "=" in arguments[1]:
            _run_generation(arguments[1:], runs["tmp"], prefect_server.env)
        elif arguments[0] == ".venv/bin/genrun" and RUN_FOLDER in arguments:
            # Block 6 filters by reward: the run with rewards; the others read the demo's folder.
            folder = runs["tools"] if block == 6 else runs["demo"]
            _run_on_folder(arguments[1:], folder, runs["tmp"])
        else:
            unknown.append(command)
            continue
        ran.append(command)
    assert not unknown, f"README commands this test neither runs nor names in NOT_RUN_HERE: {unknown}"
    assert len(ran) >= 7, ran


def _run_generation(arguments: list[str], tmp: Path, env: dict[str, str]) -> None:
    out = tmp / f"generate-{abs(hash(tuple(arguments)))}"
    done = run_genrun([*arguments, INSTANT, f"trainer.default_local_dir={out}"], env=env)
    if any(path in argument for argument in arguments for path in PLACEHOLDER_PATHS):
        # Paths that stand for the user's own: refused in one line (after the run's first line),
        # before anything is written.
        errors = [line for line in done.stderr.splitlines() if line.startswith("genrun: error: ")]
        assert done.returncode == 2 and errors == done.stderr.strip().splitlines()[-1:], done.stderr
        assert not out.exists()
        return
    assert done.returncode == 0, done.stderr[-3000:]


def _run_make_demo(arguments: list[str], tmp: Path, env: dict[str, str]) -> None:
    """`make demo ARGS=...` is `make setup`, then `.venv/bin/genrun ARGS` (the generation itself ran
    as the block's first command): make's own plan of it is checked, not a third run."""
    (assignment,) = arguments
    name, _, value = assignment.partition("=")
    assert name == "ARGS", arguments
    # --no-print-directory: under `make test` (CI) make would name the directories it enters.
    command = ["make", "--no-print-directory", "-n", "demo", f"ARGS={value}"]
    done = subprocess.run(command, cwd=REPO, env={**_environment(), **env}, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == f".venv/bin/genrun {value}", done.stdout


def _run_on_folder(arguments: list[str], folder: Path, tmp: Path) -> None:
    from flows.cli import main

    arguments = [str(folder) if argument == RUN_FOLDER else argument for argument in arguments]
    if arguments[0] == "export":
        arguments[2] = str(tmp / f"{folder.name}-{arguments[2]}")
    assert main(arguments) == 0, arguments


def _environment() -> dict[str, str]:
    import os

    return dict(os.environ)
