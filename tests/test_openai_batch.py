"""OpenAI Batch API files in and out (issue 36, items 1 and 2): a batch JSONL of chat and
completions requests is read as dataset rows (custom_id and the line's sampling parameters kept),
bad lines are refused before any work with their line numbers, and `genrun export --format
openai-batch` writes the Batch API's output layout, the same bytes after a crash and resume as
from an undisturbed run."""

from __future__ import annotations

import json
import re
from datetime import datetime

import pyarrow.parquet as pq
import pytest

from generation_core.errors import GenrunError
from generation_core.inputs.openai_batch import BatchLimits, batch_table, is_batch_file, line_sampling_params
from generation_core.store.folder import StorageFolder
from generation_core.store.run_folder import read_run_record

pytestmark = pytest.mark.timeout(300)


def _chat(custom_id, text, **body):
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "gpt-x", "messages": [{"role": "user", "content": text}], **body},
    }


def _completion(custom_id, text, **body):
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/completions",
        "body": {"model": "gpt-x", "prompt": text, **body},
    }


def _jsonl(lines) -> bytes:
    return "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines).encode()


def _write_batch(path, count: int):
    """`count` requests alternating chat (with their own temperature and max_tokens, asking for
    logprobs) and completions (with a seed)."""
    lines = [
        _chat(f"chat-{i}", f"Question {i}?", temperature=0.5, max_tokens=6, logprobs=True)
        if i % 2
        else _completion(f"text-{i}", f"Once upon a time {i}", seed=i)
        for i in range(count)
    ]
    path.write_bytes(_jsonl(lines))
    return path


def test_batch_lines_become_rows_in_verls_layout():
    content = _jsonl(
        [
            {
                "custom_id": "a",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "messages": [
                        {"role": "developer", "content": "Be brief."},
                        {
                            "role": "user",
                            "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}],
                        },
                    ],
                    "temperature": 0.2,
                    "top_p": 0.9,
                    "max_completion_tokens": 5,
                    "n": 2,
                    "seed": 7,
                    "stop": [],
                },
            },
            "",
            _completion("b", "The sky is"),
        ]
    )
    assert is_batch_file(content) and not is_batch_file(b'{"prompt": [], "extra_info": {"index": 0}}\n')
    rows = batch_table("f.jsonl", content, BatchLimits(n=2, response_length=16, calculate_log_probs=False)).to_pylist()
    assert [row["prompt"] for row in rows] == [
        [
            {"role": "system", "content": "Be brief.", "name": None},
            {"role": "user", "content": "Hi there", "name": None},
        ],
        [{"role": "user", "content": "The sky is", "name": None}],
    ]
    assert [(r["extra_info"]["index"], r["extra_info"]["custom_id"], r["extra_info"]["url"]) for r in rows] == [
        (0, "a", "/v1/chat/completions"),
        (1, "b", "/v1/completions"),
    ]
    assert line_sampling_params(rows[0]) == {"temperature": 0.2, "top_p": 0.9, "max_tokens": 5, "seed": 7}
    assert line_sampling_params(rows[1]) == {}


def test_bad_lines_are_refused_with_their_line_numbers():
    content = _jsonl(
        [
            "{broken",
            _chat("a", "one"),
            "{not json",
            {"method": "POST", "url": "/v1/chat/completions", "body": {"messages": [{"role": "user", "content": "x"}]}},
            _chat("a", "repeated"),
            {**_chat("c", "x"), "url": "/v1/embeddings"},
            _chat("d", "fine"),
        ]
    )
    with pytest.raises(GenrunError) as refused:
        batch_table("in.jsonl", content)
    message = str(refused.value)
    assert is_batch_file(content), "a broken first line does not hide the file's kind"
    assert "\n" not in message and "5 bad line(s)" in message
    for expected in (
        "line 1: not JSON",
        "line 3: not JSON",
        "line 4: no custom_id",
        "line 5: custom_id 'a' repeats (first on line 2)",
        "line 6 (custom_id 'c'): url '/v1/embeddings'",
    ):
        assert expected in message, message


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"n": 3}, "line 1 (custom_id 'a'): body.n=3 differs from actor_rollout_ref.rollout.n=2"),
        ({"max_tokens": 64}, "line 1 (custom_id 'a'): max_tokens 64 is above the run's response length 16"),
        (
            {"logprobs": True},
            "line 1 (custom_id 'a'): body.logprobs=true needs actor_rollout_ref.rollout.calculate_log_probs=true",
        ),
        ({"presence_penalty": 0.5}, "line 1 (custom_id 'a'): body.presence_penalty=0.5 is not applied"),
        ({"temperature": "hot"}, "line 1 (custom_id 'a'): body.temperature=\"hot\" is not a number"),
        ({"seed": 3}, "line 1 (custom_id 'a'): body.seed: rollout.name=sglang does not honour per-request seeds"),
    ],
)
def test_line_parameters_that_contradict_the_run_are_refused(body, message):
    with pytest.raises(GenrunError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        batch_table(
            "in.jsonl",
            _jsonl([_chat("a", "x", **body)]),
            BatchLimits(n=2, response_length=16, calculate_log_probs=False, engine="sglang"),
        )


@pytest.mark.parametrize(
    ("body", "refusal"),
    [
        ({"seed": 2**63}, "body.seed=9223372036854775808 is beyond a 64-bit integer's range"),
        ({"seed": -(2**63) - 1}, "body.seed=-9223372036854775809 is beyond a 64-bit integer's range"),
        ({"top_k": 2**70}, f"body.top_k={2**70} is beyond a 64-bit integer's range"),
        ({"max_tokens": 2**64}, f"body.max_tokens={2**64} is beyond a 64-bit integer's range"),
        ({"n": 0}, "body.n=0 must be >= 1"),
        ({"n": "2"}, 'body.n="2" is not an integer'),
        ({"top_k": -5}, "body.top_k=-5 must be >= -1"),
    ],
)
def test_integers_beyond_int64_and_n_below_one_are_refused_by_line(body, refusal):
    """Audit 2026-11-28 #13 and #18: a seed, top_k or max_tokens beyond int64 crashed preflight
    with OverflowError (Arrow's int64 column), and `"n": 0` said "set rollout.n=0", which is itself
    refused. Each is refused by line number; the range is int64's (-1 still seeds at random)."""
    line = _chat("q1", "x", **body)
    with pytest.raises(GenrunError) as refused:
        batch_table("in.jsonl", _jsonl([_chat("a", "fine"), line]))
    assert str(refused.value).startswith(
        f"OpenAI batch file in.jsonl: 1 bad line(s): line 2 (custom_id 'q1'): {refusal}"
    )
    assert batch_table("in.jsonl", _jsonl([_chat("a", "x", seed=-1, top_k=0, n=1)])).num_rows == 1


def test_a_bad_batch_file_stops_genrun_in_one_line_before_any_work(tmp_path, model_dir, capsys):
    from flows.cli import main

    batch = tmp_path / "requests.jsonl"
    batch.write_bytes(_jsonl([_chat("a", "x"), _chat("a", "y", n=4)]))
    code = main(
        [
            f"data.train_files={batch}",
            f"trainer.default_local_dir={tmp_path / 'out'}",
            f"actor_rollout_ref.model.path={model_dir}",
            "actor_rollout_ref.rollout.name=instant",
        ]
    )
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("genrun: error:")]
    assert code == 2 and len(errors) == 1, errors
    assert "line 2: custom_id 'a' repeats (first on line 1)" in errors[0]
    assert not (tmp_path / "out").exists()


class _Killed(BaseException):
    """What kill -9 leaves, in this process: the run stops at once between two parts."""


def _run_args(batch, out, model_dir):
    return [
        f"data.train_files={batch}",
        f"trainer.default_local_dir={out}",
        f"actor_rollout_ref.model.path={model_dir}",
        "actor_rollout_ref.rollout.name=instant",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.rollout.calculate_log_probs=true",
        "data.max_prompt_length=64",
        "data.max_response_length=16",
        "generation.save_batch_size=4",
        "generation.num_shards=2",
        "generation.max_inflight=4",
        "generation.show_progress=false",
        "generation.final_merge=false",
    ]


def _export(run, out):
    from generation_core.exports.export import ExportOptions, export_batch_output

    # overwrite: the crashed run is exported again, after its resume, to the same name.
    summary = export_batch_output(str(run), str(out), ExportOptions(format="openai-batch", overwrite=True))
    return summary, out.read_bytes()


def _but_created(exported: bytes) -> bytes:
    """An export without its `created` values: the time its run took its folder, which differs
    between two folders (within one folder, killed and resumed, it stays)."""
    return re.sub(rb'"created": \d+, ', b"", exported)


def test_export_after_a_crash_and_resume_equals_the_undisturbed_runs(tmp_path, model_dir, ray_local, monkeypatch):
    from generation_core.driver.in_process import run_in_process
    from generation_core.preflight.preflight import preflight
    from generation_core.shard import part_writer

    batch = _write_batch(tmp_path / "requests.jsonl", 24)
    run_in_process(preflight(_run_args(batch, tmp_path / "undisturbed", model_dir)))
    expected_summary, expected = _export(tmp_path / "undisturbed", tmp_path / "undisturbed.jsonl")

    passes = []

    def failpoint(name):
        passes.append(name)
        if name == "after_part_write" and passes.count(name) == 3:
            raise _Killed

    monkeypatch.setattr(part_writer, "failpoint", failpoint)
    with pytest.raises(_Killed):
        run_in_process(preflight(_run_args(batch, tmp_path / "crashed", model_dir)))
    monkeypatch.undo()
    partial_summary, _ = _export(tmp_path / "crashed", tmp_path / "partial.jsonl")
    assert 0 < partial_summary.requests < 24 and partial_summary.requests + partial_summary.errors == 24
    errors = [json.loads(line) for line in (tmp_path / "partial_errors.jsonl").read_text().splitlines()]
    assert {e["error"]["code"] for e in errors} == {"not_generated"} and len(errors) == partial_summary.errors

    run_in_process(preflight(_run_args(batch, tmp_path / "crashed", model_dir)))
    summary, resumed = _export(tmp_path / "crashed", tmp_path / "partial.jsonl")
    assert _but_created(resumed) == _but_created(expected) and resumed != _but_created(resumed)
    started = read_run_record(StorageFolder(str(tmp_path / "crashed"))).created
    assert {json.loads(line)["response"]["body"]["created"] for line in resumed.splitlines()} == {
        int(datetime.fromisoformat(started).timestamp())
    }
    assert not (tmp_path / "partial_errors.jsonl").exists(), (
        "the earlier export's error file is gone once every request is complete"
    )
    assert (summary.requests, summary.errors) == (expected_summary.requests, expected_summary.errors) == (24, 0)

    lines = [json.loads(line) for line in expected.decode().splitlines()]
    assert [line["custom_id"] for line in lines] == [f"chat-{i}" if i % 2 else f"text-{i}" for i in range(24)]
    assert len({line["id"] for line in lines}) == 24
    for number, line in enumerate(lines):
        body = line["response"]["body"]
        assert line["response"]["status_code"] == 200 and line["error"] is None
        assert [choice["index"] for choice in body["choices"]] == [0, 1]
        assert body["object"] == ("chat.completion" if number % 2 else "text_completion")
        key = "message" if number % 2 else "text"
        assert all(key in choice and choice["finish_reason"] in ("stop", "length") for choice in body["choices"])
        usage = body["usage"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"] > usage["prompt_tokens"]
        if number % 2:
            # The line's own max_tokens=6 bounds each of its samples (the instant engine makes 8 otherwise).
            assert usage["completion_tokens"] <= 2 * 6
            # It asked for logprobs: one per generated token.
            assert sum(len(choice["logprobs"]["content"]) for choice in body["choices"]) == usage["completion_tokens"]
            assert all(
                isinstance(t["logprob"], float) and t["top_logprobs"] == []
                for c in body["choices"]
                for t in c["logprobs"]["content"]
            )
        else:
            assert all(choice["logprobs"] is None for choice in body["choices"]), "not asked for"


def test_the_fingerprint_covers_every_byte_of_a_batch_file(tmp_path):
    """One character of one prompt changed (same length) is another dataset; the same bytes under
    another name are the same one."""
    from generation_core.config.loading import load_config
    from generation_core.inputs.dataset_files import inspect_dataset

    def digest(path):
        return inspect_dataset(
            load_config([f"data.train_files={path}", "actor_rollout_ref.rollout.name=instant"])
        ).digest

    lines = [_chat(f"c{i}", f"Question {i}?") for i in range(50)]
    first = tmp_path / "a.jsonl"
    first.write_bytes(_jsonl(lines))
    copy = tmp_path / "b.jsonl"
    copy.write_bytes(first.read_bytes())
    edited = tmp_path / "c.jsonl"
    edited.write_bytes(_jsonl([*lines[:25], _chat("c25", "Question 2X?"), *lines[26:]]))
    assert edited.stat().st_size == first.stat().st_size
    assert digest(first) == digest(copy) != digest(edited)


# ---- issue 43 items 8 and 9 (audit #11, #12, #16): odd text, roles, names, several files ----------------

SURROGATE_LINE = '{"custom_id": "s1", "url": "/v1/chat/completions", "body": {"messages": [{"role": "user", "content": "bad \\ud800 text"}]}}'


def test_a_lone_surrogate_escape_is_refused_by_line_not_a_crash():
    """Issue 43 item 8 / audit #11: a JSON escape of a lone UTF-16 surrogate ("\\ud800") parses but
    is no character; Arrow crashed on it with UnicodeEncodeError. It is a bad line like any other,
    named by number and custom_id, and the message itself stays printable (one in the custom_id too)."""
    assert "\\ud800" in SURROGATE_LINE
    bad_id = '{"custom_id": "x\\udfff", "url": "/v1/completions", "body": {"prompt": "hi"}}'
    named = '{"custom_id": "n", "url": "/v1/chat/completions", "body": {"messages": [{"role": "user", "name": "\\ud83d", "content": "x"}]}}'
    with pytest.raises(GenrunError) as refused:
        batch_table("in.jsonl", _jsonl([_chat("ok", "fine"), SURROGATE_LINE, bad_id, named]))
    message = str(refused.value)
    message.encode("utf-8")  # printable as it is
    assert message.startswith("OpenAI batch file in.jsonl: 3 bad line(s): ")
    assert "line 2 (custom_id 's1'): body.messages[0].content holds a lone surrogate escape (\\ud800)" in message
    assert "line 3: custom_id holds a lone surrogate escape (\\udfff)" in message
    assert "line 4 (custom_id 'n'): body.messages[0].name holds a lone surrogate escape (\\ud83d)" in message


def test_a_lone_surrogate_stops_genrun_in_one_line(tmp_path, model_dir, capsys):
    """Issue 43 item 8 / audit #11: through the CLI, exit 2 and one line naming the file and line,
    no traceback, nothing written."""
    from flows.cli import main

    batch = tmp_path / "surrogate.jsonl"
    batch.write_bytes(_jsonl([_chat("ok", "fine"), SURROGATE_LINE]))
    code = main(
        [
            f"data.train_files={batch}",
            f"trainer.default_local_dir={tmp_path / 'out'}",
            f"actor_rollout_ref.model.path={model_dir}",
            "actor_rollout_ref.rollout.name=instant",
        ]
    )
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("genrun: error:")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in err, err[-2000:]
    assert (
        f"OpenAI batch file {batch}: 1 bad line(s): line 2 (custom_id 's1'): body.messages[0].content holds a lone surrogate"
        in errors[0]
    )
    assert not (tmp_path / "out").exists()


def _with_messages(custom_id, messages):
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": {"messages": messages}}


@pytest.mark.parametrize("role", ["tool", "function", "banana"])
def test_roles_a_chat_template_cannot_render_are_refused_alike(role):
    """Issue 43 item 9 / audit #16: "tool" was refused but the legacy "function" role and "banana"
    went through to the chat template. One rule: system, developer (read as system), user and
    assistant; any other role is refused naming the line, the custom_id and the roles allowed."""
    content = _jsonl(
        [_chat("a", "fine"), _with_messages("q7", [{"role": "user", "content": "x"}, {"role": role, "content": "y"}])]
    )
    with pytest.raises(GenrunError) as refused:
        batch_table("in.jsonl", content)
    assert str(refused.value) == (
        f"OpenAI batch file in.jsonl: 1 bad line(s): line 2 (custom_id 'q7'): body.messages[1].role {role!r} is not one a chat "
        "template renders; use system, developer, user or assistant; fix or remove them"
    )


def test_a_message_name_is_kept():
    """Issue 43 item 9 / audit #16: a message's `name` (who speaks, in a multi-party prompt) was
    dropped; it is carried into the prompt's message (null where a message has none), and a name
    that is not text is refused."""
    content = _jsonl(
        [
            _with_messages(
                "a",
                [
                    {"role": "system", "content": "Referee."},
                    {"role": "user", "name": "alice", "content": "Hi"},
                    {"role": "developer", "name": "ops", "content": "Be fair."},
                ],
            )
        ]
    )
    (row,) = batch_table("in.jsonl", content).to_pylist()
    assert row["prompt"] == [
        {"role": "system", "content": "Referee.", "name": None},
        {"role": "user", "content": "Hi", "name": "alice"},
        {"role": "system", "content": "Be fair.", "name": "ops"},
    ]
    with pytest.raises(GenrunError, match=r"line 1 \(custom_id 'b'\): body\.messages\[0\]\.name must be text"):
        batch_table("in.jsonl", _jsonl([_with_messages("b", [{"role": "user", "name": 3, "content": "x"}])]))


def _inspect(*paths, **overrides):
    from generation_core.config.loading import load_config
    from generation_core.inputs.dataset_files import inspect_dataset

    files = "[" + ",".join(str(path) for path in paths) + "]"
    extra = [f"{key}={value}" for key, value in overrides.items()]
    return inspect_dataset(load_config([f"data.train_files={files}", "actor_rollout_ref.rollout.name=instant", *extra]))


def test_several_batch_files_number_their_requests_one_after_another(tmp_path):
    """Issue 43 item 9 / audit #12: the Batch API caps a file at 50,000 requests, so a large job
    comes as several files. Each file numbered its requests from 0, so the second file was refused
    for an `extra_info.index` the user never wrote. A later file's requests now come after the
    earlier files' (as tasks are numbered), in preflight and in the rows a shard reads."""
    from generation_core.inputs.shard_rows import read_rows

    first = tmp_path / "part-1.jsonl"
    first.write_bytes(_jsonl([_chat("a0", "x"), "", _completion("a1", "y"), _chat("a2", "z")]))
    second = tmp_path / "part-2.jsonl"
    second.write_bytes(_jsonl([_completion("b0", "u"), _chat("b1", "v")]))
    inspection = _inspect(first, second)
    assert inspection.row_indices.tolist() == [0, 1, 2, 3, 4]
    assert [(f.rows, f.first_row) for f in inspection.files.files] == [(3, 0), (2, 3)]
    table = read_rows(inspection.files, 2, 5, {})
    assert [(info["index"], info["custom_id"]) for info in table.column("extra_info").to_pylist()] == [
        (2, "a2"),
        (3, "b0"),
        (4, "b1"),
    ]
    # A plan's JSON form keeps where each file starts.
    from generation_core.run_plan import DatasetFiles

    assert DatasetFiles.from_dict(inspection.files.to_dict()) == inspection.files


def test_a_custom_id_repeated_in_another_batch_file_is_refused_naming_both(tmp_path):
    """Issue 43 item 9 / audit #12: custom_ids were checked only within one file (the export names
    requests by them), and the refusal a second file got named an internal index. A custom_id
    that repeats across files is refused naming it, the file and line of each, never an index."""
    first = tmp_path / "part-1.jsonl"
    first.write_bytes(_jsonl([_chat("a0", "x"), _chat("shared", "y")]))
    second = tmp_path / "part-2.jsonl"
    second.write_bytes(_jsonl([_chat("b0", "u"), "", _chat("shared", "v")]))
    with pytest.raises(GenrunError) as refused:
        _inspect(first, second)
    assert str(refused.value) == (
        f"OpenAI batch file {second}: 1 bad line(s): line 3: custom_id 'shared' repeats (first in {first} line 2); "
        "custom_ids must be unique across the run's batch files; fix or remove them"
    )
    with pytest.raises(
        GenrunError, match=r"line 1: custom_id 'a0': this file is listed twice in data\.train_files; list it once"
    ):
        _inspect(first, first)


@pytest.mark.timeout(600)
def test_two_batch_files_run_end_to_end_through_the_cli(tmp_path, prefect_server, capsys):
    """Issue 43 item 9 / audit #12: a run over two batch files (data.train_files as a list), the
    way a user starts it (the console script, Prefect and Ray, the instant engine), then exported:
    every request of both files once, in file and line order, under its own custom_id."""
    from flows.cli import main
    from tests.conftest import run_genrun

    first = tmp_path / "requests-1.jsonl"
    first.write_bytes(
        _jsonl([_chat("q-0", "One?"), _completion("q-1", "Two"), _chat("q-2", "Three?", temperature=0.5)])
    )
    second = tmp_path / "requests-2.jsonl"
    second.write_bytes(_jsonl([_completion("r-0", "Four"), _chat("r-1", "Five?", max_tokens=4)]))
    out = tmp_path / "run"
    reward = tmp_path / "reward.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n")
    result = run_genrun(
        [
            f"data.train_files=[{first},{second}]",
            f"trainer.default_local_dir={out}",
            "actor_rollout_ref.rollout.name=instant",
            "actor_rollout_ref.rollout.n=2",
            "generation.num_shards=2",
            "generation.save_batch_size=2",
            "generation.show_progress=false",
            "generation.final_merge=false",
            f"reward.custom_reward_function.path={reward}",
        ],
        env=prefect_server.env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "trajectories:  10 (10 generated by this invocation)" in result.stdout

    assert main(["export", str(out), str(tmp_path / "results.jsonl"), "--format", "openai-batch"]) == 0
    lines = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [line["custom_id"] for line in lines] == ["q-0", "q-1", "q-2", "r-0", "r-1"]
    assert [[choice["index"] for choice in line["response"]["body"]["choices"]] for line in lines] == [[0, 1]] * 5
    assert [line["response"]["body"]["object"] for line in lines] == [
        "chat.completion",
        "text_completion",
        "chat.completion",
        "text_completion",
        "chat.completion",
    ]
    assert not (tmp_path / "results_errors.jsonl").exists()
    # The rl-prompts layout reads the input rows as the run numbered them: request r-0 (the
    # second file's first line) is index 3, not a second index 0.
    assert main(["export", str(out), str(tmp_path / "rl.parquet"), "--layout", "rl-prompts"]) == 0
    rows = pq.read_table(tmp_path / "rl.parquet").to_pylist()
    assert [row["extra_info"]["index"] for row in rows] == [0, 1, 2, 3, 4]
    assert [row["prompt"][-1]["content"] for row in rows] == ["One?", "Two", "Three?", "Four", "Five?"]
    capsys.readouterr()
