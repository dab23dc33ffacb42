"""`genrun export`: committed trajectories of real runs as SFT Parquet. A sampled run of the
bundled model (single-turn, rewards, n=2) and a tool-calling run of verl's ToolAgentLoop with the
scripted engine; the exports are read back by `datasets`, by verl's MultiTurnSFTDataset (loss
mask checked token by token) and by the chat template (token ids checked against the parts)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from omegaconf import OmegaConf

from examples.tool_calling.calculator import SCHEMA as CALCULATOR_SCHEMA
from flows.cli import main
from generation_core.engines.hf.engine import EngineSettings, HFEngine
from generation_core.engines.instant import InstantEngine, InstantSettings
from generation_core.inputs.shard_rows import DatasetPrompts
from generation_core.outputs.merge import scan_run
from generation_core.preflight.preflight import preflight
from generation_core.report.data import collect_report_data
from generation_core.shard.rewards import RewardScorer
from generation_core.shard.streaming import StreamingWorker
from generation_core.store.folder import StorageFolder
from generation_core.store.part_repair import committed_parts, read_verified_part
from generation_core.store.run_folder import read_run_record
from generation_core.store.trajectory_record import read_part_table, score_or_none, scored_mask
from tests.conftest import REPO, write_parquet
from tests.merge_oracles import read_committed_records
from tests.scripted_engine import ScriptedEngine
from tests.shard_runs import run_shard

pytestmark = pytest.mark.timeout(300)

TOOLS = REPO / "examples" / "tool_calling" / "tools.yaml"
TOOL_REWARD = REPO / "examples" / "tool_calling" / "reward.py"
EXPRESSIONS = {"seven": "3+4", "twelve": "3*4", "nine": "(2+1)**2"}
QUESTIONS = ["Say hi.", "What is 2 + 2?", "Name a color.", "Write one short sentence about the sea."]


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from verl.utils import hf_tokenizer

    return hf_tokenizer(str(model_dir))


def _run(plan, tokenizer, engine):
    """Generate the plan's single shard into its folder with `engine`, as a shard job does."""
    plan.claim_folder()
    cfg = plan.cfg
    [shard] = plan.shards
    prompts = DatasetPrompts.for_shard(cfg, plan.dataset, shard, tokenizer)
    worker = StreamingWorker(cfg, engine, RewardScorer.from_config(cfg, tokenizer))
    try:
        return run_shard(cfg, shard, plan.folder, prompts, worker)
    finally:
        worker.shutdown()


def _plan_scored_chat_run(base, model_dir, questions, score_expression: str, *overrides: str):
    """The plan of a run over `questions` (one chat prompt each, 2 samples, prompts of at most 64
    tokens) under `base`, scored by a reward file returning `score_expression`."""
    rows = [
        {
            "data_source": "test/chat",
            "prompt": [{"role": "user", "content": q}],
            "ability": "chat",
            "reward_model": {"style": "none", "ground_truth": ""},
            "extra_info": {"split": "test", "index": i},
        }
        for i, q in enumerate(questions)
    ]
    reward = base / "reward.py"
    reward.write_text(
        f"def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):\n    return {score_expression}\n"
    )
    return preflight(
        [
            f"data.train_files={write_parquet(base / 'prompts.parquet', rows)}",
            f"trainer.default_local_dir={base / 'run'}",
            f"actor_rollout_ref.model.path={model_dir}",
            "actor_rollout_ref.rollout.n=2",
            "data.max_prompt_length=64",
            f"reward.custom_reward_function.path={reward}",
            "generation.show_progress=false",
            *overrides,
        ]
    )


@pytest.fixture(scope="module")
def sampled_run(tmp_path_factory, model_dir, tokenizer):
    """The bundled model, sampled (seeded), 2 samples of 4 prompts, at most 20 tokens each (some
    stop, some are cut), scored by the length of their text."""
    base = tmp_path_factory.mktemp("sampled")
    plan = _plan_scored_chat_run(
        base,
        model_dir,
        QUESTIONS,
        "len(solution_str) / 100",
        "actor_rollout_ref.rollout.temperature=1.0",
        "generation.sample_seed=7",
        "data.max_response_length=20",
        "generation.save_batch_size=4",
    )
    engine = HFEngine(EngineSettings(str(model_dir), prompt_length=64, response_length=20, num_threads=2))
    try:
        manifest = _run(plan, tokenizer, engine)
    finally:
        engine.shutdown()
    assert manifest.num_trajectories == 8
    return base / "run"


@pytest.fixture(scope="module")
def tool_run(tmp_path_factory, model_dir, tokenizer):
    """verl's ToolAgentLoop with the calculator, scripted (call, tool answer, final answer), 2
    samples of 3 prompts, 3 parts; prompt 1's ground truth is wrong (reward 0, the others 1)."""
    base = tmp_path_factory.mktemp("tools")
    rows = [
        {
            "data_source": "test/arithmetic",
            "prompt": [{"role": "user", "content": f"Compute {word} with the calculator."}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": "13" if index == 1 else str(eval(EXPRESSIONS[word]))},
            "extra_info": {"split": "test", "index": index},
        }
        for index, word in enumerate(EXPRESSIONS)
    ]
    plan = preflight(
        [
            f"data.train_files={write_parquet(base / 'prompts.parquet', rows)}",
            f"trainer.default_local_dir={base / 'run'}",
            f"actor_rollout_ref.model.path={model_dir}",
            "actor_rollout_ref.rollout.multi_turn.enable=true",
            f"actor_rollout_ref.rollout.multi_turn.tool_config_path={TOOLS}",
            f"reward.custom_reward_function.path={TOOL_REWARD}",
            "actor_rollout_ref.rollout.n=2",
            "data.max_prompt_length=128",
            "data.max_response_length=128",
            "generation.save_batch_size=2",
            "generation.show_progress=false",
        ]
    )
    manifest = _run(plan, tokenizer, ScriptedEngine(tokenizer, EXPRESSIONS))
    assert manifest.num_trajectories == 6
    assert len(committed_parts(plan.folder)) == 3
    return base / "run"


def _instant_run(base, model_dir, tokenizer, rows: list[dict]):
    """A one-shard run over `rows` on the instant engine (no model), no reward function; its folder."""
    plan = preflight(
        [
            f"data.train_files={write_parquet(base / 'prompts.parquet', rows)}",
            f"trainer.default_local_dir={base / 'run'}",
            f"actor_rollout_ref.model.path={model_dir}",
            "actor_rollout_ref.rollout.name=instant",
            "data.max_prompt_length=64",
            "data.max_response_length=16",
            "generation.show_progress=false",
        ]
    )
    engine = InstantEngine(InstantSettings(prompt_length=64, response_length=16, eos_token_id=tokenizer.eos_token_id))
    assert _run(plan, tokenizer, engine).num_trajectories == len(rows)
    return base / "run"


def _chat_rows(data_source: str, messages: list[list[dict]]) -> list[dict]:
    return [
        {
            "data_source": data_source,
            "prompt": prompt,
            "ability": "chat",
            "reward_model": {"style": "none", "ground_truth": ""},
            "extra_info": {"split": "test", "index": i},
        }
        for i, prompt in enumerate(messages)
    ]


@pytest.fixture(scope="module")
def unscored_run(tmp_path_factory, model_dir, tokenizer):
    """The instant engine (no model), no reward function: 3 prompts, one sample each."""
    messages = [[{"role": "user", "content": q}] for q in QUESTIONS[:3]]
    return _instant_run(
        tmp_path_factory.mktemp("unscored"), model_dir, tokenizer, _chat_rows("test/unscored", messages)
    )


@pytest.fixture(scope="module")
def nan_run(tmp_path_factory, model_dir, tokenizer):
    """The instant engine, 3 prompts x 2 samples, a reward function that returns NaN for prompt
    0 (no score) and 1 + the prompt's index for the others."""
    base = tmp_path_factory.mktemp("nan")
    plan = _plan_scored_chat_run(
        base,
        model_dir,
        QUESTIONS[:3],
        "float('nan') if extra_info['index'] == 0 else 1.0 + extra_info['index']",
        "actor_rollout_ref.rollout.name=instant",
        "data.max_response_length=16",
    )
    engine = InstantEngine(InstantSettings(prompt_length=64, response_length=16, eos_token_id=tokenizer.eos_token_id))
    assert _run(plan, tokenizer, engine).num_trajectories == 6
    return base / "run"


def _export(run, out, *options) -> list[dict]:
    assert main(["export", str(run), str(out), *options]) == 0
    return pq.read_table(out).to_pylist()


def read_committed_records_by_key(run) -> dict:
    return {record.key: record for record in read_committed_records(StorageFolder(str(run)))}


def _ids(rendered) -> list[int]:
    return list(rendered["input_ids"]) if not isinstance(rendered, list) else rendered


def _runs_of_ones(tokens, mask) -> list[list[int]]:
    """The maximal runs of `tokens` whose mask is set, in order."""
    runs, current = [], []
    for token, keep in zip(tokens, mask, strict=True):
        if keep:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    return runs + ([current] if current else [])


def _model_turns(record) -> list[list[int]]:
    """The runs of model tokens (response_mask 1) of a trajectory."""
    return _runs_of_ones(record.response_ids, record.response_mask)


def _loss_runs(item) -> list[list[int]]:
    return _runs_of_ones(item["input_ids"].tolist(), item["loss_mask"].tolist())


def _check_sft_dataset(path, records, tokenizer, tools=None):
    """verl's MultiTurnSFTDataset reads every row; its loss mask covers exactly each assistant
    turn's tokens as the model generated them, then the template's end of turn."""
    from verl.utils.dataset.multiturn_sft_dataset import MultiTurnSFTDataset

    dataset = MultiTurnSFTDataset(
        str(path), tokenizer, OmegaConf.create({"max_length": 1024, "pad_mode": "no_padding"})
    )
    assert len(dataset) == len(records)
    newline = tokenizer.encode("\n", add_special_tokens=False)
    eos = tokenizer.eos_token_id
    for position, record in enumerate(records):
        expected = [turn + newline if turn[-1] == eos else turn + [eos] + newline for turn in _model_turns(record)]
        assert _loss_runs(dataset[position]) == expected, (record.key, position)


# ---- single-turn: a real model run ------------------------------------------------------------


@pytest.mark.timeout(600)
def test_single_turn_messages_give_back_the_token_ids(sampled_run, tokenizer, tmp_path):
    rows = _export(sampled_run, tmp_path / "sft.parquet")
    records = read_committed_records_by_key(sampled_run)
    assert sorted((row["index"], row["rollout_n"]) for row in rows) == sorted(records)
    assert {row["data_source"] for row in rows} == {"test/chat"}
    newline = tokenizer.encode("\n", add_special_tokens=False)
    truncated = 0
    for row in rows:
        record = records[(row["index"], row["rollout_n"])]
        assert row["reward"] == record.reward_score and row["num_turns"] == record.num_turns == 2
        assert "tools" not in row
        # Provenance and the time split travel with the row; the hf engine reports slot wait and prefill.
        assert json.loads(row["provenance"]) == record.provenance and record.provenance["engine"] == "hf"
        assert {k: v for k, v in row["timings"].items() if k != "storage"} == record.timings
        assert (
            record.timings["slot_wait"] is not None
            and record.timings["prefill"] is not None
            and row["timings"]["storage"] is not None
        )
        messages = row["messages"]
        assert messages[0] == {"role": "user", "content": QUESTIONS[row["index"]]}
        assert [m["role"] for m in messages] == ["user", "assistant"]
        assert (
            _ids(tokenizer.apply_chat_template(messages[:1], add_generation_prompt=True, tokenize=True))
            == record.prompt_ids
        )
        rendered = _ids(tokenizer.apply_chat_template(messages, tokenize=True))
        ended = record.response_ids[-1] == tokenizer.eos_token_id
        assert row["truncated"] is (not ended)
        # The template ends the turn with eos and a newline; a cut response lacked the eos.
        assert (
            rendered == record.prompt_ids + record.response_ids + ([] if ended else [tokenizer.eos_token_id]) + newline
        )
        truncated += row["truncated"]
    assert 0 < truncated < len(rows), "the run has both kinds (response_length 20)"
    _check_sft_dataset(tmp_path / "sft.parquet", [records[(r["index"], r["rollout_n"])] for r in rows], tokenizer)

    from datasets import load_dataset

    loaded = load_dataset("parquet", data_files=str(tmp_path / "sft.parquet"), split="train")
    assert loaded.to_list() == rows


def test_min_reward_and_best_of_n(sampled_run, tmp_path):
    everything = _export(sampled_run, tmp_path / "all.parquet")
    rewards = {(row["index"], row["rollout_n"]): row["reward"] for row in everything}
    threshold = sorted(rewards.values())[len(rewards) // 2]
    kept = _export(sampled_run, tmp_path / "min.parquet", "--min-reward", str(threshold))
    assert sorted((r["index"], r["rollout_n"]) for r in kept) == sorted(k for k, v in rewards.items() if v >= threshold)

    best = {}
    for (index, n), reward in sorted(rewards.items()):
        if index not in best or reward > rewards[(index, best[index])]:
            best[index] = n
    chosen = _export(sampled_run, tmp_path / "best.parquet", "--best-of-n")
    assert sorted((r["index"], r["rollout_n"]) for r in chosen) == sorted(best.items())
    both = _export(sampled_run, tmp_path / "both.parquet", "--best-of-n", f"--min-reward={threshold}")
    assert sorted((r["index"], r["rollout_n"]) for r in both) == sorted(
        (i, n) for i, n in best.items() if rewards[(i, n)] >= threshold
    )


def test_prompt_completion_layout(sampled_run, tmp_path):
    messages = _export(sampled_run, tmp_path / "messages.parquet")
    layout = _export(sampled_run, tmp_path / "pr.parquet", "--layout", "prompt-completion")
    assert list(layout[0]) == [
        "prompt",
        "completion",
        "index",
        "rollout_n",
        "data_source",
        "reward",
        "num_turns",
        "truncated",
        "provenance",
        "timings",
    ]
    assert _export(sampled_run, tmp_path / "alias.parquet", "--layout", "prompt-response") == layout, (
        "the earlier layout name still works"
    )
    assert [
        {
            **{k: v for k, v in row.items() if k not in ("prompt", "completion")},
            "messages": row["prompt"] + row["completion"],
        }
        for row in layout
    ] == [
        {
            k: row[k]
            for k in ("index", "rollout_n", "data_source", "reward", "num_turns", "truncated", "provenance", "timings")
        }
        | {"messages": row["messages"]}
        for row in messages
    ]
    assert all(len(row["prompt"]) == 1 and [m["role"] for m in row["completion"]] == ["assistant"] for row in layout)


# ---- multi-turn: verl's tool loop ---------------------------------------------------------------


def test_tool_trajectories_become_assistant_and_tool_messages(tool_run, tokenizer, tmp_path):
    rows = _export(tool_run, tmp_path / "sft.parquet")
    records = read_committed_records_by_key(tool_run)
    engine = ScriptedEngine(tokenizer, EXPRESSIONS)
    assert sorted((row["index"], row["rollout_n"]) for row in rows) == sorted(records)
    for row in rows:
        word = list(EXPRESSIONS)[row["index"]]
        expression = EXPRESSIONS[word]
        question = f"Compute {word} with the calculator."
        assert row["messages"] == [
            {"role": "user", "content": question},
            {"role": "assistant", "content": engine.turn_text(question)},
            {"role": "tool", "content": str(eval(expression))},
            {"role": "assistant", "content": f"The answer is {eval(expression)}."},
        ]
        assert row["tools"] == [CALCULATOR_SCHEMA]
        assert (
            row["reward"] == (0.0 if row["index"] == 1 else 1.0) and row["num_turns"] == 4 and row["truncated"] is False
        )
        assert row["data_source"] == "test/arithmetic"
        # The one place the token stream and the template's rendering differ: verl's builder
        # starts the tool turn right after the call's <|im_end|>, the template puts a newline there.
        record = records[(row["index"], row["rollout_n"])]
        newline = tokenizer.encode("\n", add_special_tokens=False)
        first = record.response_mask.index(0)
        joined = record.prompt_ids + record.response_ids[:first] + newline + record.response_ids[first:] + newline
        assert _ids(tokenizer.apply_chat_template(row["messages"], tools=row["tools"], tokenize=True)) == joined
    _check_sft_dataset(tmp_path / "sft.parquet", [records[(r["index"], r["rollout_n"])] for r in rows], tokenizer)

    from datasets import load_dataset

    assert load_dataset("parquet", data_files=str(tmp_path / "sft.parquet"), split="train").to_list() == rows


def test_tool_run_filters(tool_run, tmp_path):
    def keys(*options):
        return sorted(
            (r["index"], r["rollout_n"]) for r in _export(tool_run, tmp_path / "out.parquet", "--overwrite", *options)
        )

    assert keys("--min-reward", "0.5") == [(0, 0), (0, 1), (2, 0), (2, 1)]
    assert keys("--best-of-n") == [(0, 0), (1, 0), (2, 0)], "ties: the lowest rollout_n"
    assert keys("--best-of-n", "--min-reward", "1") == [(0, 0), (2, 0)]


def test_export_to_and_from_s3(tool_run, s3_server, monkeypatch, tmp_path, capsys):
    import s3fs

    for name, value in s3_server.items():
        monkeypatch.setenv(name, value)
    endpoint = s3_server["AWS_ENDPOINT_URL"]
    fs = s3fs.S3FileSystem(endpoint_url=endpoint)
    fs.put(str(tool_run), "genrun-test/runs/export-tools", recursive=True)
    # Only the command line says where the bucket is.
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    out = "s3://genrun-test/exports/tools.parquet"
    assert main(["export", "s3://genrun-test/runs/export-tools", out, f"storage.options.endpoint_url={endpoint}"]) == 0
    assert f"exported 6 of 6 committed trajectories to {out}" in capsys.readouterr().out
    local = _export(tool_run, tmp_path / "local.parquet")
    with fs.open("genrun-test/exports/tools.parquet", "rb") as handle:
        assert pq.read_table(handle).to_pylist() == local


# ---- refusals ---------------------------------------------------------------------------------


def _refused(capsys, *arguments) -> str:
    assert main(["export", *map(str, arguments)]) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("genrun: error:")]
    assert len(errors) == 1 and "Traceback" not in err, err
    return errors[0]


def test_bad_input_is_one_line_and_exit_2(tool_run, tmp_path, capsys):
    out = tmp_path / "out.parquet"
    assert "is not a genrun run folder" in _refused(capsys, tmp_path / "nothing-here", out)
    empty = tmp_path / "empty-run"
    empty.mkdir()
    shutil.copy(tool_run / "run.json", empty / "run.json")
    assert "has no committed trajectories yet" in _refused(capsys, empty, out)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    assert "a-file" in _refused(capsys, tool_run, blocker / "out.parquet")
    assert "is a directory" in _refused(capsys, tool_run, tmp_path)
    assert "--min-reward 'high' is not a number" in _refused(capsys, tool_run, out, "--min-reward", "high")
    assert "--layout 'chat' is not one of messages, prompt-completion" in _refused(
        capsys, tool_run, out, "--layout=chat"
    )
    assert "unknown option '--best'" in _refused(capsys, tool_run, out, "--best")
    assert "usage: genrun export RUN_DIR OUT" in _refused(capsys, tool_run)
    assert "only storage.options.KEY=VALUE may follow" in _refused(capsys, tool_run, out, "storage.bad=1")
    assert "no trajectory of" in _refused(capsys, tool_run, out, "--min-reward", "2")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "empty-run"], "nothing written, no temporary files"


def test_a_failure_half_way_writes_nothing(tool_run, tmp_path, capsys):
    damaged = tmp_path / "damaged"
    shutil.copytree(tool_run, damaged)
    last = committed_parts(StorageFolder(str(damaged)))[-1]
    part = damaged / last.path
    part.write_bytes(part.read_bytes()[:-10] + b"0123456789")
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    (out_dir / "sft.parquet").write_bytes(b"the previous export")
    assert "does not match the checksum" in _refused(capsys, damaged, out_dir / "sft.parquet", "--overwrite")
    assert [p.name for p in out_dir.iterdir()] == ["sft.parquet"] and (
        out_dir / "sft.parquet"
    ).read_bytes() == b"the previous export"


# ---- another template family: Qwen2.5's tool turns, built by verl's Qwen builder ----------------

# Qwen2.5-Instruct's chat template: tool answers become one user turn of <tool_response> blocks.
QWEN25_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
    "{%- else %}{{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}{%- endif %}"
    '{{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}'
    '{%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}'
    '{{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}'
    "{%- else %}{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}{%- endif %}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or (message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>' + message.role }}{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' }}{{- tool_call.name }}{{- '\", \"arguments\": ' }}{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != 'tool') %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def test_qwen_tool_turns_are_cut_back_into_tool_messages(model_dir):
    """Two parallel tool answers, then a user turn, as verl's Qwen continuous-token builder
    appends them (a newline inserted after the stopped <|im_end|>), come back as two tool
    messages and one user message; a run of context tokens no template shape explains is kept
    as raw text and counted."""
    from transformers import AutoTokenizer
    from verl.utils.tokenizer.continuous_token import QwenContinuousTokenBuilder

    from generation_core.exports.sft_messages import MessageRebuilder

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    tokenizer.chat_template = QWEN25_TEMPLATE
    tools = [CALCULATOR_SCHEMA]
    builder = QwenContinuousTokenBuilder(tokenizer)
    prompt = [{"role": "user", "content": "Compute seven and twelve."}]
    prompt_ids = builder.build_initial_tokens(prompt, tools=tools)
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "3+4"}}\n</tool_call>\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "3*4"}}\n</tool_call>'
    stream, mask = list(prompt_ids), []

    def assistant(text):
        ids = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
        stream.extend(ids)
        mask.extend([1] * len(ids))

    def context(previous, added):
        merged = builder.merge_context_tokens(previous, previous + added, stream, tools=tools)
        mask.extend([0] * (len(merged.token_ids) - len(stream)))
        stream[:] = merged.token_ids

    history = [*prompt, {"role": "assistant", "content": call}]
    assistant(call)
    answers = [{"role": "tool", "content": "7"}, {"role": "tool", "content": "12"}]
    context(history, answers)
    assistant("Both done.")
    history += [*answers, {"role": "assistant", "content": "Both done."}]
    context(history, [{"role": "user", "content": "Now add them."}])
    assistant("19")

    rebuilder = MessageRebuilder(tokenizer, tools, eos_token_ids={tokenizer.convert_tokens_to_ids("<|im_end|>")})
    rebuilt = rebuilder.rebuild(prompt, stream[len(prompt_ids) :], mask)
    assert rebuilt.messages == [
        *prompt,
        {"role": "assistant", "content": call},
        *answers,
        {"role": "assistant", "content": "Both done."},
        {"role": "user", "content": "Now add them."},
        {"role": "assistant", "content": "19"},
    ]
    assert not rebuilt.truncated and rebuilt.unmatched_turns == 0

    odd = tokenizer.encode(
        "<|im_start|>observation\nsomething<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False
    )
    ids = stream[len(prompt_ids) :][: mask.index(0)] + odd
    rebuilt = rebuilder.rebuild(prompt, ids, [1] * mask.index(0) + [0] * len(odd))
    assert rebuilt.messages[-1] == {"role": "user", "content": tokenizer.decode(odd, skip_special_tokens=False)}
    assert rebuilt.unmatched_turns == 1 and rebuilt.truncated is False


def test_a_run_without_rewards(unscored_run, model_dir, tmp_path, capsys):
    rows = _export(unscored_run, tmp_path / "sft.parquet")
    assert sorted(row["index"] for row in rows) == [0, 1, 2]
    assert all(row["reward"] is None and row["data_source"] == "test/unscored" for row in rows)
    assert "exported 3 of 3 committed trajectories" in capsys.readouterr().out
    # The run's model folder is not needed when --tokenizer names one.
    assert _export(unscored_run, tmp_path / "again.parquet", "--tokenizer", str(model_dir)) == rows
    assert "does not exist here" in _refused(
        capsys, unscored_run, tmp_path / "x.parquet", "--tokenizer", str(tmp_path / "no-tokenizer")
    )
    assert "has a reward, which --min-reward needs" in _refused(
        capsys, unscored_run, tmp_path / "x.parquet", "--min-reward", "0"
    )
    assert "has a reward, which --best-of-n needs" in _refused(
        capsys, unscored_run, tmp_path / "x.parquet", "--best-of-n"
    )
    assert not (tmp_path / "x.parquet").exists()


def test_a_nan_reward_is_no_reward_everywhere(nan_run, tmp_path, capsys):
    """One rule (NaN = no score): stored as null, exported as null, no rm_scores in the merge, the
    report's viewer shows no reward, and --best-of-n leaves the unscored prompt out, saying so."""
    folder = StorageFolder(str(nan_run))
    stored = [
        table.column("reward_score")
        for table in (read_part_table(read_verified_part(folder, part)) for part in committed_parts(folder))
    ]
    assert sum(column.null_count for column in stored) == 2
    rows = _export(nan_run, tmp_path / "sft.parquet")
    assert {row["index"]: row["reward"] for row in rows} == {0: None, 1: 2.0, 2: 3.0}
    assert not scan_run(folder).layout.with_rm_scores
    report = collect_report_data(folder, read_run_record(folder), frozenset(), sample_size=10)
    assert {record.index: record.reward_score for record in report.sample} == {0: None, 1: 2.0, 2: 3.0}
    assert int(np.isnan(report.stats.reward).sum()) == 2
    capsys.readouterr()
    best = _export(nan_run, tmp_path / "best.parquet", "--best-of-n")
    assert sorted((row["index"], row["rollout_n"]) for row in best) == [(1, 0), (2, 0)]
    line = capsys.readouterr().out
    assert "2 not the best of their prompt" in line and "2 of prompts with no scored trajectory" in line


def test_a_nan_in_a_part_written_before_the_rule_reads_as_no_score():
    """Parts may hold NaN (written by an older genrun): every reader goes through the rule."""
    table = pa.table({"reward_score": pa.array([1.0, float("nan"), None])})
    assert scored_mask(table.column("reward_score")).to_pylist() == [True, False, False]
    assert [score_or_none(value) for value in table.column("reward_score").to_pylist()] == [1.0, None, None]


MARKER_CODE = """
import pathlib
pathlib.Path(MARKER).write_text("ran")
from BASE_MODULE import BASE_CLASS


class MarkerCLASS(BASE_CLASS):
    pass
"""
MARKER_TOOLS = """
tools:
  - class_name: marker_tool.MarkerTool
    config: {type: native}
    tool_schema:
      type: function
      function:
        name: lookup
        description: Look a word up.
        parameters: {type: object, properties: {word: {type: string, description: the word}}, required: [word]}
"""


def _folder_naming_code(run, model_dir, base) -> tuple:
    """A copy of `run` whose run.json says trust_remote_code: true and names a model folder whose
    tokenizer is code (auto_map) and a tool class; each writes its marker file when imported."""
    import json

    markers = (base / "tokenizer-code-ran", base / "tool-code-ran")
    model = base / "model"
    model.mkdir()
    for name in (
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "config.json",
        "generation_config.json",
    ):
        if (model_dir / name).exists():
            shutil.copy(model_dir / name, model / name)
    tokenizer_config = json.loads((model / "tokenizer_config.json").read_text())
    tokenizer_config.update(
        tokenizer_class="MarkerTokenizer", auto_map={"AutoTokenizer": [None, "tokenization_marker.MarkerTokenizer"]}
    )
    (model / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    code = MARKER_CODE.replace("BASE_MODULE", "transformers").replace("BASE_CLASS", "PreTrainedTokenizerFast")
    (model / "tokenization_marker.py").write_text(
        code.replace("MARKER", repr(str(markers[0]))).replace("CLASS(", "Tokenizer(")
    )
    code = MARKER_CODE.replace("BASE_MODULE", "verl.tools.base_tool").replace("BASE_CLASS", "BaseTool")
    (base / "marker_tool.py").write_text(code.replace("MARKER", repr(str(markers[1]))).replace("CLASS(", "Tool("))
    (base / "tools.yaml").write_text(MARKER_TOOLS)
    folder = base / "run"
    shutil.copytree(run, folder)
    record = json.loads((folder / "run.json").read_text())
    record["config"]["actor_rollout_ref"]["model"].update(path=str(model), trust_remote_code=True)
    record["config"]["actor_rollout_ref"]["rollout"]["multi_turn"]["tool_config_path"] = str(base / "tools.yaml")
    (folder / "run.json").write_text(json.dumps(record))
    return folder, markers


def test_reading_a_folder_runs_no_code_it_names_unless_asked(unscored_run, model_dir, tmp_path, capsys, monkeypatch):
    """run.json may name code (a tokenizer's auto_map, tool classes) and say trust_remote_code:
    genrun report and export run none of it without --trust-remote-code on their command line:
    the report shows token ids (saying why, once), export takes the tool schemas the tool config
    declares and refuses a tokenizer that is code, in one line."""
    monkeypatch.syspath_prepend(str(tmp_path))
    folder, markers = _folder_naming_code(unscored_run, model_dir, tmp_path)

    assert main(["report", str(folder)]) == 0
    assert not markers[0].exists(), "the report ran the tokenizer's code"
    err = capsys.readouterr().err
    assert err.count("--trust-remote-code") == 1, err
    assert '"decoded":false' in (folder / "report.html").read_text()
    assert "is code from that folder" in _refused(capsys, folder, tmp_path / "x.parquet")
    declared = _export(folder, tmp_path / "declared.parquet", "--tokenizer", str(model_dir))
    assert declared[0]["tools"][0]["function"]["name"] == "lookup"
    assert not [m.name for m in markers if m.exists()], "no code from the folder ran"

    assert main(["export", str(folder), str(tmp_path / "trusted.parquet"), "--trust-remote-code"]) == 0
    assert pq.read_table(tmp_path / "trusted.parquet").to_pylist() == declared, (
        "the declared schemas are the ones the tool classes build"
    )
    assert main(["report", str(folder), "--trust-remote-code"]) == 0
    assert '"decoded":true' in (folder / "report.html").read_text()
    assert all(m.exists() for m in markers), "asked for, the code ran"


def test_the_export_writes_a_dataset_card_beside_its_file(nan_run, tmp_path):
    """README.md beside the Parquet (Hugging Face's dataset card): what generated the rows, how
    many, their rewards and lengths, the filters; a README.md that is not a card is never overwritten."""
    record = read_run_record(StorageFolder(str(nan_run)))
    every = _export(nan_run, tmp_path / "all" / "sft.parquet")
    card = (tmp_path / "all" / "README.md").read_text()
    assert card.startswith("---\ntags:\n- genrun\n") and '    path: "sft.parquet"\n' in card
    assert f"| run fingerprint | `{record.fingerprint}` |" in card and "| engine | `instant` |" in card
    assert "| committed trajectories | 6 |" in card and "| exported rows | 6 |" in card
    assert "- none: every committed trajectory" in card
    assert "4 of 6 rows scored: mean 2.5, std 0.5, min 2, max 3; 4 above 0." in card
    lengths = sorted(len(row["messages"]) for row in every)
    assert "- turns: mean 2.0, median 2, p90 2, min 2, max 2" in card and lengths == [2] * 6

    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "README.md").write_text("my project\n")
    kept = _export(nan_run, tmp_path / "mine" / "best.parquet", "--min-reward", "2.5")
    assert sorted(row["index"] for row in kept) == [2, 2]
    assert (tmp_path / "mine" / "README.md").read_text() == "my project\n"
    card = (tmp_path / "mine" / "best.parquet.README.md").read_text()
    assert "| exported rows | 2 |" in card and "2 of 2 rows scored: mean 3, std 0, min 3, max 3" in card
    assert "- `--min-reward 2.5`: kept trajectories scored at least 2.5 (4 dropped, unscored ones included)" in card


def test_prompt_message_keys_the_layout_cannot_hold_are_named_not_dropped_silently(
    model_dir, tokenizer, tmp_path, capsys
):
    """A prompt message's `name` (or `tool_calls`, ...) has no field in the {"role", "content"}
    layouts: the export still writes the row, and its summary line names each such key with the
    number of rows whose prompt set it, instead of leaving it out without a word."""
    messages = [
        [{"role": "user", "content": q, "name": "alice" if i == 1 else None}] for i, q in enumerate(QUESTIONS[:3])
    ]
    run = _instant_run(tmp_path, model_dir, tokenizer, _chat_rows("test/named", messages))
    capsys.readouterr()
    exported = _export(run, tmp_path / "sft.parquet")
    line = capsys.readouterr().out
    assert "exported 3 of 3 committed trajectories" in line
    assert line.rstrip().endswith("; prompt message keys the layout has no field for, not exported: name (1 rows)"), (
        line
    )
    assert [message.keys() for row in exported for message in row["messages"]] == [{"role", "content"}] * 6


def test_openai_batch_input_gives_a_batch_runs_requests_back_as_they_were(tmp_path, model_dir):
    """Issue 51 item 6: `--format openai-batch-input` of a run over a batch file turned `developer`
    into `system` and added `"logprobs": true` to every line, a `/v1/completions` line too (where
    the API takes an integer). Each request comes back with everything it set; the run's sampling
    fills only what it left out. The run need not have started: the export reads its input."""
    from generation_core.exports.export import export_batch_input
    from generation_core.exports.export_options import ExportOptions

    chat, completions = "/v1/chat/completions", "/v1/completions"
    messages = [{"role": "developer", "content": "Answer in one word."}, {"role": "user", "content": "Say hi."}]
    requests = [
        ("req-1", chat, {"model": "gpt-x", "messages": messages, "max_tokens": 12}),
        ("req-2", chat, {"model": "gpt-x", "messages": messages[1:], "max_completion_tokens": 8, "temperature": 0}),
        ("req-3", chat, {"model": "gpt-x", "messages": messages[1:], "logprobs": True}),
        ("req-4", completions, {"model": "gpt-x", "prompt": "Once upon a time", "max_tokens": 8}),
    ]
    lines = [{"custom_id": custom_id, "method": "POST", "url": url, "body": body} for custom_id, url, body in requests]
    batch = tmp_path / "requests.jsonl"
    batch.write_text("".join(json.dumps(line) + "\n" for line in lines))
    plan = preflight(
        [
            f"data.train_files={batch}",
            f"trainer.default_local_dir={tmp_path / 'run'}",
            f"actor_rollout_ref.model.path={model_dir}",
            "actor_rollout_ref.rollout.name=instant",
            "actor_rollout_ref.rollout.calculate_log_probs=true",
            "actor_rollout_ref.rollout.temperature=0.7",
            "data.max_prompt_length=64",
            "data.max_response_length=16",
        ]
    )
    plan.claim_folder()
    summary = export_batch_input(
        str(tmp_path / "run"), str(tmp_path / "again.jsonl"), ExportOptions(format="openai-batch-input")
    )
    assert summary.line().endswith(
        "(each as the run's batch file holds it; the run's sampling added where it set none)"
    )
    again = [json.loads(line) for line in (tmp_path / "again.jsonl").read_text().splitlines()]
    run = {"n": 1, "temperature": 0.7, "top_p": 1.0}
    assert again == [
        dict(lines[0], body={**run, **lines[0]["body"]}),
        dict(lines[1], body={**run, **lines[1]["body"]}),
        dict(lines[2], body={**run, "max_tokens": 16, **lines[2]["body"]}),
        dict(lines[3], body={**run, **lines[3]["body"]}),
    ]
    assert again[0]["body"]["messages"][0]["role"] == "developer" and "logprobs" not in again[3]["body"]


def test_the_end_of_sequence_ids_are_the_models_not_the_tokenizer_folders(unscored_run, model_dir, tmp_path):
    """Review 2026-11-28 §6.1, Llama-3 style: the model's generation_config.json lists the turn end
    (here <|im_end|>, id 2) and the tokenizer's own eos is another token (<|endoftext|>), while
    the tokenizer folder (`tokenizer_path`) has no generation_config.json. The export read the ids
    from the tokenizer folder: the turn end stayed in the assistant text, flagged truncated. One
    rule now (engines.base.eos_token_ids) for the engine, the export and the viewer."""
    tokenizer_folder = tmp_path / "tokenizer"
    tokenizer_folder.mkdir()
    for name in ("tokenizer.json", "chat_template.jinja"):
        shutil.copy(model_dir / name, tokenizer_folder / name)
    settings = json.loads((model_dir / "tokenizer_config.json").read_text())
    settings.update(eos_token="<|endoftext|>", eos_token_id=0)
    (tokenizer_folder / "tokenizer_config.json").write_text(json.dumps(settings))
    folder = tmp_path / "run"
    shutil.copytree(unscored_run, folder)
    record = json.loads((folder / "run.json").read_text())
    record["config"]["actor_rollout_ref"]["model"]["tokenizer_path"] = str(tokenizer_folder)
    (folder / "run.json").write_text(json.dumps(record))

    rows = _export(folder, tmp_path / "sft.parquet")
    assert len(rows) == 3
    assert [row["truncated"] for row in rows] == [False] * 3
    answers = [row["messages"][-1]["content"] for row in rows]
    assert [answer for answer in answers if "<|im_end|>" in answer] == []
    assert rows == _export(unscored_run, tmp_path / "own.parquet"), "as with the model's own tokenizer"


def test_one_rule_gives_the_end_of_sequence_ids(tmp_path):
    """engines.base.eos_token_ids: generation_config.json's (an int or a list), then
    config.json's and its text_config's, then the tokenizer's; each once, in that order."""
    from generation_core.engines.base import eos_token_ids

    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [128001, 128009]}))
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 128001, "text_config": {"eos_token_id": 7}}))
    tokenizer = type("Tokenizer", (), {"eos_token_id": 3})()
    assert eos_token_ids(str(tmp_path), tokenizer) == (128001, 128009, 7, 3)
    assert eos_token_ids(str(tmp_path / "absent")) == ()
