"""`genrun export`'s files: where they may go (never into the run folder, never over a file without
--overwrite), one dataset card per folder listing every export in it, rows in (index, rollout_n)
order, every option in `--help`, and the OpenAI batch layouts (an adaptive run's decided
requests in the output layout, the input layout), both checked against the `openai` package's
own types. One adaptive run over a batch file on the instant engine serves every test."""

from __future__ import annotations

import json
import re
import shutil
from datetime import datetime
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from flows.cli import USAGE, main
from generation_core.engines.instant import InstantEngine, InstantSettings
from generation_core.errors import GenrunError
from generation_core.exports.export import ExportOptions, export_batch_input, export_batch_output, export_run
from generation_core.preflight.preflight import preflight
from generation_core.store.folder import StorageFolder
from generation_core.store.part_repair import committed_parts, read_verified_part
from generation_core.store.run_folder import COMMITS_DIR, SUCCESS_FILE, read_run_record
from generation_core.store.trajectory_record import read_part_table
from tests.conftest import REPO
from tests.test_export import _refused, _run

pytestmark = pytest.mark.timeout(180)

QUESTIONS = ["Say hi.", "What is 2 + 2?", "Name a color.", "Write one short sentence about the sea."]
LONG = "Please repeat this sentence many times over. " * 30


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from verl.utils import hf_tokenizer

    return hf_tokenizer(str(model_dir))


@pytest.fixture(scope="module")
def adaptive_batch_run(tmp_path_factory, model_dir, tokenizer) -> Path:
    """An OpenAI batch file of 5 chat requests, n=4 drawn in two rounds (adaptive_k=2) on the
    instant engine: requests 0 and 1 score 1 (decided by their first 2 samples), 2 and 3 have no
    score (undecided: all 4 samples, the last two in the second round's part), request 4 is longer
    than data.max_prompt_length (dropped by verl's filter)."""
    base = tmp_path_factory.mktemp("adaptive-batch")
    lines = [
        {
            "custom_id": f"req-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": "any", "messages": [{"role": "user", "content": q}]},
        }
        for i, q in enumerate([*QUESTIONS, LONG])
    ]
    batch = base / "requests.jsonl"
    batch.write_text("".join(json.dumps(line) + "\n" for line in lines))
    reward = base / "reward.py"
    reward.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):\n"
        "    return 1.0 if extra_info['index'] < 2 else float('nan')\n"
    )
    plan = preflight(
        [
            f"data.train_files={batch}",
            f"trainer.default_local_dir={base / 'run'}",
            f"actor_rollout_ref.model.path={model_dir}",
            "actor_rollout_ref.rollout.name=instant",
            "actor_rollout_ref.rollout.n=4",
            "generation.adaptive=true",
            "generation.adaptive_k=2",
            "data.max_prompt_length=64",
            "data.max_response_length=16",
            f"reward.custom_reward_function.path={reward}",
            "generation.show_progress=false",
        ]
    )
    engine = InstantEngine(InstantSettings(prompt_length=64, response_length=16, eos_token_id=tokenizer.eos_token_id))
    manifest = _run(plan, tokenizer, engine)
    assert (manifest.num_trajectories, manifest.filtered_overlong, manifest.not_owed) == (2 * 2 + 2 * 4, 1, 2 * 2)
    return base / "run"


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(path.relative_to(folder)): path.read_bytes() for path in sorted(folder.rglob("*")) if path.is_file()}


# ---- the OpenAI batch layouts -----------------------------------------------------------------


def test_openai_batch_of_an_adaptive_run_exports_what_was_decided(adaptive_batch_run, tmp_path):
    """Issue 43 item 3 / audit #4: a request adaptive sampling decided by its first adaptive_k
    samples is exported with those k choices (today: every decided request went to the error file
    as "the run has not finished", 0 exported, exit 0), and an error line's reason is the true one:
    a prompt dropped as overlong says so in a finished run, and a run that has not finished says
    that instead. Output bodies parse as the openai package's ChatCompletion, `created` included."""
    from openai.types.chat import ChatCompletion

    summary = export_batch_output(
        str(adaptive_batch_run), str(tmp_path / "out.jsonl"), ExportOptions(format="openai-batch")
    )
    assert (summary.requests, summary.errors, summary.decided) == (4, 1, 2)
    assert "(2 decided by their first 2 samples, with that many choices)" in summary.line()
    lines = _lines(tmp_path / "out.jsonl")
    assert [line["custom_id"] for line in lines] == ["req-0", "req-1", "req-2", "req-3"]
    assert [[choice["index"] for choice in line["response"]["body"]["choices"]] for line in lines] == [
        [0, 1],
        [0, 1],
        [0, 1, 2, 3],
        [0, 1, 2, 3],
    ]
    created = read_run_record(StorageFolder(str(adaptive_batch_run))).created
    for line in lines:
        completion = ChatCompletion.model_validate(line["response"]["body"])
        assert completion.created > 0 and completion.object == "chat.completion"
        assert completion.usage is not None and completion.usage.completion_tokens > 0
    assert lines[0]["response"]["body"]["created"] == int(datetime.fromisoformat(created).timestamp())
    [error] = _lines(tmp_path / "out_errors.jsonl")
    assert error["custom_id"] == "req-4" and error["response"] is None and error["error"]["code"] == "not_generated"
    assert error["error"]["message"].startswith("the prompt is longer than data.max_prompt_length (64 tokens)"), error

    # The same folder before its shard's done record: the run has not finished.
    unfinished = tmp_path / "unfinished"
    shutil.copytree(adaptive_batch_run, unfinished)
    [shard] = (unfinished / "shards").iterdir()
    done = [path for path in (shard / COMMITS_DIR).iterdir() if json.loads(path.read_text())["kind"] == "done"]
    for path in [*done, shard / SUCCESS_FILE]:
        path.unlink()
    export_batch_output(str(unfinished), str(tmp_path / "early.jsonl"), ExportOptions(format="openai-batch"))
    assert [line["custom_id"] for line in _lines(tmp_path / "early.jsonl")] == ["req-0", "req-1", "req-2", "req-3"]
    [error] = _lines(tmp_path / "early_errors.jsonl")
    assert error["error"]["message"].startswith(
        "0 of 4 samples committed: the run has not finished (1 of 1 shard(s) not done"
    ), error


def test_openai_batch_input_layout_is_the_runs_prompts_and_sampling(adaptive_batch_run, tmp_path):
    """Issue 45 item 9: `--format openai-batch-input` writes the Batch API's input layout, one line
    per prompt of the run (the overlong one too), with the run's sampling where the line set none;
    each body validates as the openai package's chat completion request."""
    from openai.types.chat.completion_create_params import CompletionCreateParamsNonStreaming
    from pydantic import TypeAdapter

    summary = export_batch_input(
        str(adaptive_batch_run), str(tmp_path / "requests.jsonl"), ExportOptions(format="openai-batch-input")
    )
    assert summary.requests == 5
    lines = _lines(tmp_path / "requests.jsonl")
    assert [line["custom_id"] for line in lines] == [f"req-{i}" for i in range(5)]
    assert {(line["method"], line["url"]) for line in lines} == {("POST", "/v1/chat/completions")}
    assert [line["body"]["messages"] for line in lines] == [
        [{"role": "user", "content": q}] for q in [*QUESTIONS, LONG]
    ]
    first = lines[0]["body"]
    assert (first["n"], first["max_tokens"], first["temperature"], first["top_p"]) == (4, 16, 1.0, 1.0)
    assert "logprobs" not in first and "top_k" not in first, "the run kept no logprobs and sampled without top_k"
    request = TypeAdapter(CompletionCreateParamsNonStreaming)
    for line in lines:
        assert isinstance(line["custom_id"], str) and set(line) == {"custom_id", "method", "url", "body"}
        parsed = request.validate_python(line["body"])
        # The batch line's own model: a request comes back as it was (issue 51 item 6).
        assert len(list(parsed["messages"])) == 1 and parsed["model"] == "any"


# ---- where an export may write ----------------------------------------------------------------


def test_an_output_inside_the_run_folder_is_refused(adaptive_batch_run, tmp_path, capsys):
    """Issue 43 item 4 / audit #7: `genrun export RUN RUN/trajectories.pkl` replaced the merged
    pickle; no output inside the run folder (however named: a subfolder, a symbolic link, any
    format or layout) is written, in one line, exit 2, with the run folder unchanged."""
    before = _snapshot(adaptive_batch_run)
    link = tmp_path / "link"
    link.symlink_to(adaptive_batch_run)
    for out, *options in [
        (adaptive_batch_run / "trajectories.pkl",),
        (adaptive_batch_run / "run.json", "--overwrite"),
        (adaptive_batch_run / "exports" / "sft.parquet",),
        (link / "sft.parquet",),
        (adaptive_batch_run / "out.jsonl", "--format", "openai-batch"),
        (adaptive_batch_run / "requests.jsonl", "--format", "openai-batch-input"),
        (adaptive_batch_run / "rl.parquet", "--layout", "rl-prompts"),
    ]:
        assert "is inside the run folder" in _refused(capsys, adaptive_batch_run, out, *options)
    assert _snapshot(adaptive_batch_run) == before


def test_an_existing_output_is_replaced_only_with_overwrite(adaptive_batch_run, tmp_path, capsys):
    """Issue 43 item 4: an existing output (or the error file an OpenAI batch export writes beside
    it) is refused in one line, exit 2, unchanged; --overwrite replaces it."""
    out = tmp_path / "sft.parquet"
    out.write_bytes(b"an earlier export")
    assert "sft.parquet exists; add --overwrite" in _refused(capsys, adaptive_batch_run, out)
    assert out.read_bytes() == b"an earlier export" and sorted(p.name for p in tmp_path.iterdir()) == ["sft.parquet"]
    (tmp_path / "out_errors.jsonl").write_text("earlier errors\n")
    assert "out_errors.jsonl exists; add --overwrite" in _refused(
        capsys, adaptive_batch_run, tmp_path / "out.jsonl", "--format", "openai-batch"
    )
    assert (tmp_path / "out_errors.jsonl").read_text() == "earlier errors\n"
    export_run(str(adaptive_batch_run), str(out), ExportOptions(overwrite=True))
    assert pq.read_table(out).num_rows == 12
    with pytest.raises(GenrunError, match="exists; add --overwrite"):
        export_run(str(adaptive_batch_run), str(out), ExportOptions())


def test_every_export_in_a_folder_keeps_its_dataset_card(adaptive_batch_run, tmp_path, monkeypatch):
    """Issue 43 item 4 / audit #8: a second export into a folder replaced the first's card, so
    `load_dataset(folder)` read only the second file. One README.md lists every export (a config
    per file, the first the default, a section each); re-exporting one with --overwrite replaces
    only its entry, and the card of an earlier genrun (one file) keeps its entry."""
    import datasets

    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    folder = tmp_path / "exports"
    run = str(adaptive_batch_run)
    export_run(run, str(folder / "a.parquet"), ExportOptions())
    export_run(run, str(folder / "b.parquet"), ExportOptions(layout="prompt-completion", min_reward=1.0))
    card = (folder / "README.md").read_text()
    assert card.count("<!-- genrun export of ") == 2 and "## a.parquet" in card and "## b.parquet" in card
    assert '- config_name: "a"\n  default: true\n  data_files:\n  - split: train\n    path: "a.parquet"' in card
    assert '- config_name: "b"\n  data_files:\n  - split: train\n    path: "b.parquet"' in card
    assert "| exported rows | 12 |" in card and "| exported rows | 4 |" in card
    assert datasets.load_dataset(str(folder))["train"].column_names[0] == "messages"
    assert datasets.load_dataset(str(folder), "b")["train"].num_rows == 4

    export_run(run, str(folder / "a.parquet"), ExportOptions(min_reward=1.0, overwrite=True))
    card = (folder / "README.md").read_text()
    assert card.count("<!-- genrun export of ") == 2 and card.index("## a.parquet") < card.index("## b.parquet")
    assert "`--min-reward 1`" in card.split("## b.parquet")[0], "a.parquet's entry describes its new export"

    # A card as the genrun before this one wrote it: one file, config `default`.
    old = tmp_path / "old"
    old.mkdir()
    shutil.copy(folder / "b.parquet", old / "first.parquet")
    (old / "README.md").write_text(
        "---\ntags:\n- genrun\n- synthetic\nconfigs:\n- config_name: default\n  data_files:\n  - split: train\n"
        "    path: first.parquet\n---\n<!-- written by genrun export -->\n# first.parquet\n\n"
        "Trajectories generated by genrun.\n\n## Rows\n\n| exported rows | 4 |\n"
    )
    export_run(run, str(old / "second.parquet"), ExportOptions())
    card = (old / "README.md").read_text()
    assert "## first.parquet\n\nTrajectories generated by genrun.\n\n### Rows\n" in card and "## second.parquet" in card
    assert (
        datasets.load_dataset(str(old))["train"].num_rows == 4
        and datasets.load_dataset(str(old), "second")["train"].num_rows == 12
    )


# ---- rows and options -------------------------------------------------------------------------


def test_rows_come_out_sorted_by_index_and_rollout_n(adaptive_batch_run, tmp_path):
    """Issue 45 item 7: exported rows are in (index, rollout_n) order across parts (the second
    round's part follows the first's, so the parts in commit order are not)."""
    folder = StorageFolder(str(adaptive_batch_run))
    committed = [
        key
        for part in committed_parts(folder)
        for key in zip(
            *(
                read_part_table(read_verified_part(folder, part), ["index", "rollout_n"]).column(c).to_pylist()
                for c in ("index", "rollout_n")
            ),
            strict=True,
        )
    ]
    assert committed != sorted(committed), "the run's parts must be out of key order for this test to hold anything"
    for options in (ExportOptions(), ExportOptions(layout="prompt-completion", best_of_n=True)):
        out = tmp_path / f"{options.layout}.parquet"
        export_run(str(adaptive_batch_run), str(out), options)
        keys = [
            (row["index"], row["rollout_n"]) for row in pq.read_table(out, columns=["index", "rollout_n"]).to_pylist()
        ]
        assert keys == sorted(keys) and len(keys) == (12 if not options.best_of_n else 2)


def _documented_export_options() -> set[str]:
    """Every `--option` the export sections of docs/outputs.md name."""
    text = (REPO / "docs" / "outputs.md").read_text()
    sections = text[text.index("## SFT export") : text.index("## Run report")]
    return set(re.findall(r"(?<![\w-])--[a-z][a-z-]*[a-z]", sections))


def test_every_export_option_is_in_help(capsys):
    """Issue 45 item 7: `--pass-threshold` was documented but missing from `genrun export --help`
    and `genrun --help`; every option docs/outputs.md documents for export is in both, and every
    layout and format name is in `genrun export --help`."""
    documented = _documented_export_options()
    assert {
        "--pass-threshold",
        "--overwrite",
        "--min-reward",
        "--best-of-n",
        "--layout",
        "--format",
        "--pass-rate",
    } <= documented
    assert main(["export", "--help"]) == 0
    help_text = capsys.readouterr().out
    assert help_text.startswith("usage:\n")
    missing = sorted(option for option in documented if option not in help_text)
    assert not missing, f"documented but not in genrun export --help: {missing}"
    top = USAGE.split("genrun export", 1)[1].split("genrun bench", 1)[0]
    assert not sorted(option for option in documented if option not in top), "genrun --help lists every export option"
    for name in ("messages", "prompt-completion", "rl-prompts", "parquet", "openai-batch", "openai-batch-input"):
        assert name in help_text
