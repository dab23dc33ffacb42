"""The read-only commands load no engine stack (issue 32, item 2): `genrun status` imports no
torch, verl, Ray, transformers or Prefect, nor omegaconf (the plan's vocabulary lives in
generation_core/run_plan.py, and status.py reads run.json and the commit records only). Each
command runs in a fresh interpreter, as a user types it; what it loaded is read from
sys.modules at its end, so an import hidden in a function counts too.

What the other read-only commands load: `genrun report` loads transformers (and with it torch)
only to read the run's tokenizer when its model folder is on this machine, and no verl or Ray
(tests/test_report.py asserts both cases on its run). `genrun export` always loads the run's
tokenizer through verl (and verl's tool schemas for a tool run), so verl, torch and Ray come
with it; `genrun merge` writes verl's DataProto (torch, tensordict, verl.protocol)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from generation_core.store.commit_log import ShardCheckpoint, write_marker
from generation_core.store.folder import StorageFolder
from generation_core.store.run_folder import PartEntry, SuccessMarker, shard_name
from tests.conftest import REPO

pytestmark = pytest.mark.timeout(120)

ENGINE_STACK = ("torch", "verl", "ray", "transformers", "prefect")

_RUN_AND_LIST = (
    "import json, sys\n"
    "from flows.cli import main\n"
    "code = main(sys.argv[1:])\n"
    "print(json.dumps({'code': code, 'loaded': sorted({name.partition('.')[0] for name in sys.modules})}), file=sys.stderr)\n"
)


def command_loads(arguments: list[str], expected_code: int = 0) -> set[str]:
    """The top-level packages that `genrun ARGUMENTS` has imported by its end (it must exit with
    `expected_code`)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(
        [sys.executable, "-c", _RUN_AND_LIST, *arguments],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=100,
    )
    result = json.loads(done.stderr.strip().splitlines()[-1])
    assert result["code"] == expected_code, done.stderr
    return set(result["loaded"])


@pytest.mark.parametrize(
    "override",
    [
        "actor_rollout_ref.rollout.temprature=0",
        "data.train_files=/no/such/prompts.parquet",
        "data.prompt_key=no_such_column",
    ],
)
def test_a_refused_input_loads_no_engine_stack(tmp_path, override):
    """Issue 45 item 3: a typo'd key, a missing data file or a missing column is refused before
    verl, torch, Ray, transformers or Prefect are imported (they cost ~9 s of CPU on 2 cores), so
    the refusal comes at once; bench/startup.py --refusals times it."""
    loaded = command_loads([override, f"trainer.default_local_dir={tmp_path / 'run'}"], expected_code=2)
    assert sorted(loaded & set(ENGINE_STACK)) == []
    assert not (tmp_path / "run").exists()


def finished_shards_folder(path, shards: int, rows: int = 3) -> StorageFolder:
    """run.json and, per shard, a committed part's record, its done record and its marker, as a
    finished shard leaves them (the part files themselves are not written: status reads none)."""
    folder = StorageFolder(str(path))
    folder.put_json(
        "run.json",
        {
            "fingerprint": "f" * 64,
            "rollout_n": 1,
            "pad_token_id": 0,
            "shards": [{"name": shard_name(i), "range": [i * rows, (i + 1) * rows]} for i in range(shards)],
            "config": {"actor_rollout_ref": {"rollout": {"prompt_length": 4, "response_length": 4}}, "generation": {}},
        },
    )
    for i in range(shards):
        name, keys = shard_name(i), [f"{i * rows + row}:0" for row in range(rows)]
        part = PartEntry(name="part-00000.parquet", count=rows, bytes=1, sha256="0" * 64)
        ShardCheckpoint.start_attempt(folder, name).commit_part(folder, name, part, keys)
        write_marker(
            folder,
            SuccessMarker(
                shard=name,
                shard_id=i,
                range=[i * rows, (i + 1) * rows],
                num_trajectories=rows,
                expected_trajectories=rows,
                parts=[part],
            ),
        )
    return folder


def test_status_loads_no_engine_stack(tmp_path):
    folder = finished_shards_folder(tmp_path / "run", shards=2)
    # A third shard, interrupted: one sample failed, nothing committed.
    run = folder.read_json("run.json")
    run["shards"].append({"name": shard_name(2), "range": [6, 9]})
    folder.put_json("run.json", run)
    ShardCheckpoint().commit_part(folder, shard_name(2), None, [], failed=["6:0"])
    loaded = command_loads(["status", str(tmp_path / "run")])
    assert sorted(loaded & {*ENGINE_STACK, "omegaconf", "hydra"}) == []


def test_the_plan_vocabulary_is_light_to_import():
    """generation_core/run_plan.py, which every task and read-only path passes plans through:
    omegaconf (the plan's config) and fsspec (its StorageFolder), no engine stack."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    listing = "import sys, generation_core.run_plan; print(' '.join(sorted({name.partition('.')[0] for name in sys.modules})))"
    loaded = set(
        subprocess.run(
            [sys.executable, "-c", listing], cwd=REPO, env=env, capture_output=True, text=True, check=True, timeout=60
        ).stdout.split()
    )
    assert "omegaconf" in loaded and sorted(loaded & set(ENGINE_STACK)) == []
