"""The same command on a finished run (driver/finished_run.py) answers from the folder only when
what the merge wrote is there whole and in the layout the settings ask for; it names the folder
given; a damaged manifest.json sends it the usual way. And what a finished run's readers say of a
damaged part, and what the merge cleans up (audit 2026-11-28, #3, #4, #8, #9, #11, #16).

One instant-engine run (8 prompts, two parts) is made once; each case works on a copy of it."""

from __future__ import annotations

import json
import shutil
import uuid

import pytest

from generation_core.driver.finished_run import finished_run
from generation_core.preflight.preflight import check_inputs
from generation_core.store.folder import StorageFolder
from tests.conftest import chat_rows, write_parquet
from tests.run_folder_helpers import checkpoint_dict

pytestmark = pytest.mark.timeout(300)

PROMPTS = 8


@pytest.fixture(scope="module")
def finished(ray_local, tmp_path_factory):
    """(prompts file, a finished run folder over it)."""
    from generation_core.driver.in_process import run_in_process
    from generation_core.preflight.preflight import preflight

    tmp = tmp_path_factory.mktemp("finished")
    prompts = write_parquet(tmp / "prompts.parquet", chat_rows(PROMPTS))
    assert run_in_process(preflight(_args(prompts, tmp / "run")))["num_trajectories"] == PROMPTS
    return prompts, tmp / "run"


def _args(prompts, out, *extra: str) -> list[str]:
    return [
        f"data.train_files={prompts}",
        f"trainer.default_local_dir={out}",
        "actor_rollout_ref.rollout.name=instant",
        "generation.save_batch_size=4",
        "generation.show_progress=false",
        *extra,
    ]


def _copy(finished, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(finished[1], copy)
    return copy


def _answer(finished, out, *extra: str):
    inputs = check_inputs(_args(finished[0], out, *extra))
    return finished_run(inputs.cfg, inputs.fingerprint, inputs.dataset.files)


def _cut(path, size: int) -> None:
    path.write_bytes(path.read_bytes()[:size])


def test_a_copied_run_is_answered_with_the_folder_given(finished, tmp_path, capsys):
    """#16: the answer names the copy (manifest.json names the folder the run was made in)."""
    from flows.run_command import print_finished

    copy = _copy(finished, tmp_path)
    answer = _answer(finished, copy)
    assert answer is not None
    print_finished(answer)
    lines = capsys.readouterr().out.splitlines()
    assert lines[:3] == [
        f"output:        {copy}",
        f"artifact:      {copy / 'trajectories.pkl'} ({PROMPTS} rows)",
        f"trajectories:  {PROMPTS} (every shard finished, merged output current: nothing to generate)",
    ]
    assert str(finished[1]) not in "\n".join(lines)


@pytest.mark.parametrize(
    "damage",
    ["trajectories.pkl cut", "trajectories.zip cut", "manifest.json cut", "manifest.json a list"],
)
def test_a_damaged_merged_output_or_manifest_takes_the_usual_path(finished, tmp_path, damage):
    """#3, #11: a cut trajectories.pkl or zip is not "current"; an unreadable or non-object
    manifest.json means "not finished" (it crashed every rerun with a traceback)."""
    copy = _copy(finished, tmp_path)
    name, how = damage.split(" ", 1)
    if how == "cut":
        _cut(copy / name, 100 if name != "manifest.json" else 50)
    else:
        (copy / name).write_text("[1, 2]\n")
    assert _answer(finished, copy) is None


def test_status_says_a_cut_merged_output_is_damaged(finished, tmp_path, capsys):
    """#3: `genrun status` said `merged: yes (trajectories.pkl)` of a 100-byte trajectories.pkl."""
    from generation_core.outputs.status import print_status

    copy = _copy(finished, tmp_path)
    print_status(str(copy))
    assert "merged: yes (trajectories.pkl)" in capsys.readouterr().out.splitlines()
    _cut(copy / "trajectories.pkl", 100)
    print_status(str(copy))
    merged = [line for line in capsys.readouterr().out.splitlines() if line.startswith("merged:")]
    assert len(merged) == 1 and merged[0].startswith("merged: damaged, trajectories.pkl is 100 bytes, the merge wrote ")
    assert merged[0].endswith(f": the run's command (or `genrun merge {copy}`) merges again")


def test_a_changed_merge_layout_or_a_missing_chunk_takes_the_usual_path(finished, tmp_path):
    """#3, #4: a generation.merge_chunk_size other than the merged layout on disk is merged again
    (so is a merge_max_file_bytes the run does not fit in: the merge's own rule decides); so is a
    chunk missing."""
    from generation_core.driver.in_process import run_in_process
    from generation_core.preflight.preflight import preflight

    copy = _copy(finished, tmp_path)
    assert _answer(finished, copy, "generation.merge_chunk_size=4") is None
    # A limit the run fits in asks for the same one file (merged_output.merge_chunk_rows, the merge's rule).
    assert _answer(finished, copy, "generation.merge_max_file_bytes=1048576") is not None

    summary = run_in_process(preflight(_args(finished[0], copy, "generation.merge_chunk_size=4")))
    assert summary["this_invocation"]["trajectories"] == 0
    index = json.loads((copy / "trajectories.json").read_text())
    assert [chunk["rows"] for chunk in index["chunks"]] == [4, 4] and not (copy / "trajectories.pkl").exists()
    answer = _answer(finished, copy, "generation.merge_chunk_size=4")
    assert answer is not None and answer["artifact"] == str(copy / "trajectories.json")
    assert _answer(finished, copy) is None, "one trajectories.pkl asked, chunks on disk"
    (copy / "trajectories-00001.pkl").unlink()
    assert _answer(finished, copy, "generation.merge_chunk_size=4") is None


def test_a_run_without_the_final_merge_says_it_is_not_merged(finished, tmp_path, capsys):
    """#16: with generation.final_merge=false the answer does not call a merged output current."""
    from flows.run_command import print_finished
    from generation_core.driver.in_process import run_in_process
    from generation_core.preflight.preflight import preflight

    copy = _copy(finished, tmp_path)
    for name in ("trajectories.pkl", "trajectories.zip", "manifest.json"):
        (copy / name).unlink()
    run_in_process(preflight(_args(finished[0], copy, "generation.final_merge=false")))
    answer = _answer(finished, copy, "generation.final_merge=false")
    assert answer is not None and "artifact" not in answer
    print_finished(answer)
    assert (
        f"trajectories:  {PROMPTS} (every shard finished, not merged (generation.final_merge=false): nothing to generate)"
        in capsys.readouterr().out.splitlines()
    )
    assert _answer(finished, copy) is None, "the default merges"


def test_the_merge_removes_what_a_killed_merge_left_at_the_folders_root(finished, tmp_path):
    """#9: a kill -9 during the merge left `.tmp-<hex>-trajectories.pkl` for ever; the next merge
    (holding the lease) removes it, and the zip's and manifest's; report.html's stays (`genrun
    report` writes it without the lease)."""
    from generation_core.outputs.finish import merge_folder

    copy = _copy(finished, tmp_path)
    left = [f".tmp-{uuid.uuid4().hex}-{name}" for name in ("trajectories.pkl", "trajectories.zip", "manifest.json")]
    report_tmp = f".tmp-{uuid.uuid4().hex}-report.html"
    for name in (*left, report_tmp):
        (copy / name).write_bytes(b"partial")
    merge_folder(str(copy))
    assert sorted(p.name for p in copy.iterdir() if p.name.startswith(".tmp-")) == [report_tmp]


def _flip_every_part(copy) -> list[str]:
    names = [part["name"] for part in checkpoint_dict(copy)["parts"]]
    for name in names:
        path = copy / "shards" / "shard-00000" / name
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x01
        path.write_bytes(bytes(data))
    return names


def test_export_and_report_of_a_same_size_corruption_name_genrun_merge(finished, tmp_path, capsys):
    """#8: a same-size corruption of a finished run's parts: export and report said nothing of the
    way out (the report even said "no committed trajectories yet"); both name `genrun merge DIR`,
    which drops the parts so that the same command regenerates them."""
    from flows.cli import main

    copy = _copy(finished, tmp_path)
    names = _flip_every_part(copy)
    advice = f"run `genrun merge {copy}` (it drops the damaged part), then the same command to regenerate its samples"

    assert main(["export", str(copy), str(tmp_path / "sft.parquet")]) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert (
        error.startswith("genrun: error: part ") and "does not match the checksum" in error and error.endswith(advice)
    )
    assert not (tmp_path / "sft.parquet").exists()

    assert main(["report", str(copy)]) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error == (
        f"genrun: error: every committed part of {copy} (2, e.g. shards/shard-00000/{names[0]}) no longer matches "
        f"the checksum its checkpoint recorded: nothing to report; {advice}"
    )
    assert "no committed trajectories" not in error

    assert main(["merge", str(copy)]) == 2
    assert _answer(finished, copy) is None, "the dropped part's shard is unfinished: the same command regenerates it"
    assert StorageFolder(str(copy)).exists("run.json")


# ---- exports: refusals in one line, and a partial export said so ----------------------------------


def _refusal(capsys, *arguments) -> str:
    from flows.cli import main

    assert main(["export", *map(str, arguments)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return err.strip().splitlines()[-1]


def test_export_refuses_a_name_its_format_does_not_write_a_batch_layout_of_parquet_input_and_names_out(
    finished, tmp_path, capsys
):
    """#18: out.csv (or no extension) got Parquet under that name, silently; #12: --format
    openai-batch of a run over Parquet input crashed in pyarrow's JSON parser; #17: an unwritable
    output folder was blamed on trainer.default_local_dir, which export does not take."""
    prompts, run = finished
    out = tmp_path / "out"
    out.mkdir()
    assert _refusal(capsys, run, out / "sft.csv") == (
        f"genrun: error: output '{out / 'sft.csv'}' does not end in .parquet, and --format parquet writes Parquet "
        "there (a reader goes by the name): name it e.g. sft.parquet"
    )
    assert "name it e.g. sft.parquet" in _refusal(capsys, run, out / "sft")
    assert "name it e.g. rl.parquet" in _refusal(capsys, run, out / "rl.json", "--layout", "rl-prompts")
    assert _refusal(capsys, run, out / "prompts.parquet", "--format", "openai-batch-input").endswith(
        "does not end in .jsonl, and --format openai-batch-input writes JSON lines there (a reader goes by the "
        "name): name it e.g. prompts.jsonl"
    )
    assert _refusal(capsys, run, out / "results.jsonl", "--format", "openai-batch") == (
        f"genrun: error: {run} was generated from {prompts}, a Parquet file: --format openai-batch needs a run over "
        "an OpenAI batch file; use the default layout or --format openai-batch-input"
    )
    unwritable = _refusal(capsys, run, "/proc/genrun-export/sft.parquet")
    assert unwritable.startswith("genrun: error: cannot write to output folder /proc/genrun-export: ")
    assert unwritable.endswith("; choose a writable OUT") and "trainer.default_local_dir" not in unwritable
    assert list(out.iterdir()) == [], "nothing written"


def test_an_export_of_an_unfinished_run_says_it_is_partial(finished, tmp_path, capsys):
    """#19: the export's line and its card said nothing of the run being unfinished."""
    from flows.cli import main

    copy = _copy(finished, tmp_path)
    shard = copy / "shards" / "shard-00000"
    # The second part's record and the done record never landed: 4 of the 8 trajectories committed.
    for name in ("_SUCCESS.json", "commits/0000000002.json", "commits/0000000003.json"):
        (shard / name).unlink()
    partial = "run not finished: 4 of 8 planned trajectories committed (0 of 1 shards finished)"
    assert main(["export", str(copy), str(tmp_path / "sft.parquet")]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("exported 4 of 4 committed trajectories") and line.endswith(f"; partial: {partial}")
    card = (tmp_path / "README.md").read_text()
    assert "| committed trajectories | 4 |" in card and "| planned trajectories (run not finished) | 8 |" in card

    assert main(["export", str(finished[1]), str(tmp_path / "all.parquet")]) == 0
    assert "partial" not in capsys.readouterr().out
    assert "run not finished" not in (tmp_path / "README.md").read_text().split("## all.parquet")[1]
