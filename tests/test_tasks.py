"""Tasks instead of preprocessing scripts (issue 36, item 0) and the rl-prompts export (item 5).

Tasks are built offline from a local Parquet file and from a dataset saved with `save_to_disk`;
a custom task class adds the ground truth. The built files are cached (a second preflight builds
nothing), enter the fingerprint by content (and the class by its source), and a bad task is
refused in one line. A run of the instant engine over the built tasks, scored by a reward whose
pass rate per prompt is known, exports one row per prompt with its pass rate, which verl's
RLHFDataset reads."""

from __future__ import annotations

import hashlib
import json
import os
import sys
import uuid
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from omegaconf import OmegaConf

from flows.cli import main
from generation_core.engines.instant import InstantEngine, InstantSettings
from generation_core.errors import GenrunError
from generation_core.inputs.shard_rows import DatasetPrompts
from generation_core.inputs.task_build import build_tasks, task_configs
from generation_core.inputs.task_cache import input_files, log_hub_build
from generation_core.preflight.preflight import preflight
from generation_core.shard.rewards import RewardScorer
from generation_core.shard.streaming import StreamingWorker
from tests.conftest import write_parquet
from tests.shard_runs import run_shard

pytestmark = pytest.mark.timeout(300)

ROLLOUT_N = 4
CUSTOM_TASK = '''
from generation_core.inputs.tasks import Task


class WithAnswer(Task):
    """The answer after '####' as the ground truth, as verl's gsm8k preprocessing takes it."""

    def build_row(self, row, index):
        built = super().build_row(row, index)
        built["reward_model"] = {"style": "rule", "ground_truth": row["answer"].split("####")[-1].strip()}
        return built
'''
# "yes" passes every sample, "no" none; "half" by one bit of the response's hash (a seed per
# sample makes the instant engine's responses differ; the test reads those prompts' rewards).
REWARD = """
import hashlib


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    if ground_truth == "yes":
        return 1.0
    if ground_truth == "no":
        return 0.0
    return float(hashlib.sha256(solution_str.encode()).digest()[0] % 2)
"""


@pytest.fixture(scope="module")
def task_inputs(tmp_path_factory):
    import datasets

    base = tmp_path_factory.mktemp("task-inputs")
    write_parquet(
        base / "questions.parquet",
        [
            {
                "question": f"What is {i} + {i}?",
                "answer": f"#### {'yes' if i % 3 == 0 else 'no' if i % 3 == 1 else 'half'}",
            }
            for i in range(6)
        ],
    )
    saved = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict(
                {
                    "messages": [[{"role": "user", "content": f"Say {word}."}] for word in ("hi", "bye")],
                    "topic": ["a", "b"],
                }
            ),
            "test": datasets.Dataset.from_dict({"messages": [[{"role": "user", "content": "unused"}]], "topic": ["c"]}),
        }
    )
    saved.save_to_disk(str(base / "saved"))
    (base / "custom_task.py").write_text(CUSTOM_TASK)
    (base / "reward.py").write_text(REWARD)
    return base


def _tasks(base, template="Q: {question}", split="train", custom_name="WithAnswer") -> str:
    return (
        f"data.train_tasks=[{{loading_params:{{path:parquet,data_files:'{base}/questions.parquet'}},"
        f"prompt_format:{{type:template,prompt_template:'{template}',system_prompt:'Answer briefly.'}},"
        f"data_source:local/questions,extra_fields:[question],custom_cls:{{path:'{base}/custom_task.py',name:{custom_name}}}}},"
        f"{{loading_params:{{path:'{base}/saved',split:{split}}},prompt_format:{{type:chat_messages,chat_messages_field:messages}},"
        "data_source:local/saved,extra_fields:[topic]}]"
    )


def _overrides(base, tmp_path, model_dir, *extra):
    return [
        _tasks(base),
        f"data.task_cache_dir={tmp_path / 'cache'}",
        f"trainer.default_local_dir={tmp_path / 'run'}",
        f"actor_rollout_ref.model.path={model_dir}",
        "actor_rollout_ref.rollout.name=instant",
        f"actor_rollout_ref.rollout.n={ROLLOUT_N}",
        "data.max_prompt_length=64",
        "data.max_response_length=16",
        "generation.show_progress=false",
        "generation.sample_seed=7",
        f"reward.custom_reward_function.path={base / 'reward.py'}",
        *extra,
    ]


def test_tasks_build_into_cached_train_files_that_enter_the_fingerprint(task_inputs, tmp_path, model_dir):
    plan = preflight(_overrides(task_inputs, tmp_path, model_dir))
    files = list(plan.cfg.data.train_files)
    assert len(files) == 2 and all(f.startswith(str(tmp_path / "cache")) for f in files)
    questions, saved = (pq.read_table(f).to_pylist() for f in files)
    assert questions[0] == {
        "data_source": "local/questions",
        "prompt": [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Q: What is 0 + 0?"}],
        "ability": "",
        "reward_model": {"style": "rule", "ground_truth": "yes"},
        # The tasks' files share one schema: a field another task has is null here.
        "extra_info": {"question": "What is 0 + 0?", "index": 0, "topic": None},
    }
    assert [row["reward_model"]["ground_truth"] for row in questions] == ["yes", "no", "half"] * 2
    # The second task's rows: the train split only, indexed after the first task's.
    assert [(row["prompt"], row["extra_info"]) for row in saved] == [
        ([{"role": "user", "content": "Say hi."}], {"question": None, "index": 6, "topic": "a"}),
        ([{"role": "user", "content": "Say bye."}], {"question": None, "index": 7, "topic": "b"}),
    ]
    assert plan.dataset.num_rows == 8

    # Cached: the same tasks again build nothing (the files are not rewritten) and keep the run.
    stamps = [os.stat(f).st_mtime_ns for f in files]
    again = preflight(_overrides(task_inputs, tmp_path, model_dir, f"data.task_cache_dir={tmp_path / 'cache'}"))
    assert list(again.cfg.data.train_files) == files and [os.stat(f).st_mtime_ns for f in files] == stamps
    assert again.fingerprint == plan.fingerprint
    # Another cache folder, and the tasks from a YAML file: the same content, the same run (the
    # built files enter by content).
    listed = OmegaConf.to_container(OmegaConf.select(plan.cfg, "data.train_tasks"))
    OmegaConf.save(OmegaConf.create(listed), tmp_path / "tasks.yaml")
    moved = preflight(
        [
            f"data.train_tasks={tmp_path / 'tasks.yaml'}",
            *_overrides(
                task_inputs,
                tmp_path,
                model_dir,
                f"data.task_cache_dir={tmp_path / 'cache2'}",
                f"trainer.default_local_dir={tmp_path / 'run2'}",
            )[1:],
        ]
    )
    assert moved.fingerprint == plan.fingerprint and list(moved.cfg.data.train_files) != files

    # The task class's source is in the key and the fingerprint: an edit rebuilds, another run.
    custom = task_inputs / "custom_task.py"
    original = custom.read_text()
    try:
        custom.write_text(original.replace(".strip()}", ".strip().upper()}"))
        edited = preflight(
            _overrides(task_inputs, tmp_path, model_dir, f"trainer.default_local_dir={tmp_path / 'run3'}")
        )
    finally:
        custom.write_text(original)
    assert edited.fingerprint != plan.fingerprint and list(edited.cfg.data.train_files)[0] != files[0]
    assert pq.read_table(list(edited.cfg.data.train_files)[0]).to_pylist()[0]["reward_model"]["ground_truth"] == "YES"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"template": "Q: {questoin}"},
            "data.train_tasks[0].prompt_format.prompt_template: unknown column 'questoin'; the dataset's columns: question, answer",
        ),
        ({"split": "validation"}, "data.train_tasks[1].loading_params.split='validation' is not in"),
        ({"custom_name": "Missing"}, "data.train_tasks[0].custom_cls.name='Missing': "),
    ],
)
def test_a_bad_task_is_refused_in_one_line(task_inputs, tmp_path, model_dir, change, message):
    overrides = _overrides(task_inputs, tmp_path, model_dir)
    overrides[0] = _tasks(task_inputs, **change)
    with pytest.raises(GenrunError) as raised:
        preflight(overrides)
    assert message in str(raised.value) and "\n" not in str(raised.value)


def test_a_task_class_that_fails_to_import_and_tasks_beside_train_files_are_refused(task_inputs, tmp_path, model_dir):
    broken = tmp_path / "broken.py"
    broken.write_text("import not_a_module_anywhere\n")
    overrides = _overrides(task_inputs, tmp_path, model_dir)
    overrides[0] = overrides[0].replace(f"'{task_inputs}/custom_task.py'", f"'{broken}'")
    with pytest.raises(GenrunError, match=r"custom_cls.path=.*fails to import: ModuleNotFoundError"):
        preflight(overrides)
    with pytest.raises(GenrunError, match="data.train_tasks and data.train_files=.* are both set"):
        preflight(
            [*_overrides(task_inputs, tmp_path, model_dir), f"data.train_files={task_inputs / 'questions.parquet'}"]
        )


def test_rl_prompts_export_gives_pass_rates_that_verls_dataset_reads(task_inputs, tmp_path, model_dir, capsys):
    from verl.utils import hf_tokenizer
    from verl.utils.dataset.rl_dataset import RLHFDataset

    from generation_core.exports.rl_prompts import prompt_rewards
    from generation_core.store.part_repair import committed_parts

    plan = preflight(_overrides(task_inputs, tmp_path, model_dir))
    plan.claim_folder()
    tokenizer = hf_tokenizer(str(model_dir))
    [shard] = plan.shards
    prompts = DatasetPrompts.for_shard(plan.cfg, plan.dataset, shard, tokenizer)
    worker = StreamingWorker(
        plan.cfg,
        InstantEngine(InstantSettings(prompt_length=64, response_length=16, eos_token_id=tokenizer.eos_token_id)),
        RewardScorer.from_config(plan.cfg, tokenizer),
    )
    try:
        manifest = run_shard(plan.cfg, shard, plan.folder, prompts, worker)
    finally:
        worker.shutdown()
    assert manifest.num_trajectories == 8 * ROLLOUT_N
    committed = {
        index: rewards.rewards for index, rewards in prompt_rewards(plan.folder, committed_parts(plan.folder)).items()
    }
    rates = {index: sum(r > 0 for r in rewards) / len(rewards) for index, rewards in committed.items()}
    assert [rates[i] for i in (0, 3)] == [1.0, 1.0] and [rates[i] for i in (1, 4)] == [0.0, 0.0]
    assert any(0 < rate < 1 for rate in rates.values()), "the band below keeps something"

    out = tmp_path / "all.parquet"
    assert main(["export", str(tmp_path / "run"), str(out), "--layout", "rl-prompts"]) == 0
    rows = pq.read_table(out).to_pylist()
    assert [row["extra_info"]["index"] for row in rows] == list(range(8))
    card = (tmp_path / "README.md").read_text()
    assert "layout `rl-prompts`" in card and "| exported prompts (rows) | 8 |" in card and "- pass rate: mean" in card
    for row in rows:
        info, rewards = row["extra_info"], committed[row["extra_info"]["index"]]
        assert (info["pass_rate"], info["num_samples"], info["num_passed"]) == (
            rates[info["index"]],
            ROLLOUT_N,
            sum(r > 0 for r in rewards),
        )
        assert (info["reward_min"], info["reward_max"], info["reward_mean"]) == (
            min(rewards),
            max(rewards),
            sum(rewards) / ROLLOUT_N,
        )
    # The original rows, unchanged but for extra_info.
    source = pq.read_table(list(plan.cfg.data.train_files)[0]).to_pylist()
    assert {k: v for k, v in rows[0].items() if k != "extra_info"} == {
        k: v for k, v in source[0].items() if k != "extra_info"
    }

    band = tmp_path / "band.parquet"
    assert (
        main(["export", str(tmp_path / "run"), str(band), "--layout", "rl-prompts", "--pass-rate", "0.01", "0.99"]) == 0
    )
    kept = sorted(index for index, rate in rates.items() if 0.01 <= rate <= 0.99)
    assert [row["extra_info"]["index"] for row in pq.read_table(band).to_pylist()] == kept
    assert f"exported {len(kept)} of 8 prompts" in capsys.readouterr().out

    # verl's RLHFDataset reads the export as training data.
    cfg = plan.cfg.data.copy()
    cfg.train_files = [str(out)]
    dataset = RLHFDataset([str(out)], tokenizer, cfg, processor=None, max_samples=-1)
    assert len(dataset) == 8
    assert dataset[1]["extra_info"]["pass_rate"] == 0.0 and dataset[0]["reward_model"]["ground_truth"] == "yes"

    assert (
        main(["export", str(tmp_path / "run"), str(band), "--layout", "rl-prompts", "--pass-rate", "0.9", "0.1"]) == 2
    )
    assert main(["export", str(tmp_path / "run"), str(band), "--pass-rate", "0", "1"]) == 2


# ---- issue 43: the task cache's key, content that is text, rows that do not build ----------------


def _build(tmp_path, *tasks):
    """build_tasks over these task mappings, cached under tmp_path/cache: [(rows, url)] per task."""
    data = {"train_tasks": list(tasks), "prompt_key": "prompt", "task_cache_dir": str(tmp_path / "cache")}
    cfg = OmegaConf.create({"data": {**data, "storage_options": None}, "storage": {"options": {}}})
    return [(pq.read_table(task.url).to_pylist(), task.url) for task in build_tasks(cfg)]


def _jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _template_task(data_files, template="Q: {question}", **extra):
    loading = {"path": "json", "data_files": str(data_files)}
    prompt_format = {"type": "template", "prompt_template": template}
    return {"loading_params": loading, "prompt_format": prompt_format, "data_source": "t", **extra}


def _chat_task(data_files):
    prompt_format = {"type": "chat_messages", "chat_messages_field": "messages"}
    return {"loading_params": {"path": "json", "data_files": str(data_files)}, "prompt_format": prompt_format}


def _questions(built):
    return [row["prompt"][-1]["content"] for row in built[0][0]]


HELPER_TASK = """
from generation_core.inputs.tasks import Task
from helper_gt43 import gt


class WithHelper(Task):
    def build_row(self, row, index):
        built = super().build_row(row, index)
        built["reward_model"] = {"style": "rule", "ground_truth": gt(row)}
        return built
"""


@pytest.mark.timeout(120)
def test_editing_a_module_the_task_class_imports_rebuilds_the_task(tmp_path, monkeypatch):
    """Issue 43 item 1 / audit #1: the cache key holds the local modules the custom_cls file
    imports (the fingerprint's code walk), not only the class's own file: a helper edited gives
    rows built by the new helper, never the old helper's ground truths."""
    _jsonl(tmp_path / "data.jsonl", [{"question": "2+2", "answer": "4"}])
    (tmp_path / "helper_gt43.py").write_text('def gt(row):\n    return row["answer"] + "-v1"\n')
    (tmp_path / "mytask.py").write_text(HELPER_TASK)
    custom_cls = {"path": str(tmp_path / "mytask.py"), "name": "WithHelper"}
    task = _template_task(tmp_path / "data.jsonl", custom_cls=custom_cls)
    [(rows, first_url)] = _build(tmp_path, task)
    assert rows[0]["reward_model"]["ground_truth"] == "4-v1"

    (tmp_path / "helper_gt43.py").write_text('def gt(row):\n    return row["answer"] + "-v2"\n')
    monkeypatch.delitem(sys.modules, "helper_gt43")  # a new genrun process imports the file afresh
    [(rows, second_url)] = _build(tmp_path, task)
    assert second_url != first_url and rows[0]["reward_model"]["ground_truth"] == "4-v2"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("loading", ["glob", "data_dir"])
def test_globbed_and_data_dir_inputs_rebuild_when_a_file_changes_or_appears(tmp_path, loading):
    """Issue 43 item 1 / audit #2: every file a `data_files` glob or a `data_dir` reads is in the
    key (listed through fsspec): an edited file and a new file rebuild the task."""
    data = tmp_path / "d"
    _jsonl(data / "a.jsonl", [{"question": f"q{i}"} for i in range(3)])
    params = {"path": "json", **({"data_files": f"{data}/*.jsonl"} if loading == "glob" else {"data_dir": str(data)})}
    task = {"loading_params": params, "prompt_format": {"prompt_template": "Q: {question}"}, "data_source": loading}
    assert _questions(_build(tmp_path, task)) == ["Q: q0", "Q: q1", "Q: q2"]

    _jsonl(data / "a.jsonl", [{"question": f"EDITED{i}"} for i in range(3)])
    _jsonl(data / "b.jsonl", [{"question": "NEWFILE"}])
    assert _questions(_build(tmp_path, task)) == ["Q: EDITED0", "Q: EDITED1", "Q: EDITED2", "Q: NEWFILE"]


@pytest.mark.timeout(120)
def test_a_remote_input_rebuilds_when_its_content_changes(tmp_path):
    """Issue 43 item 1 / audit #2: a URL input (an fsspec filesystem; memory:// stands in for a
    bucket) is keyed by what fsspec reports of it (size, ETag, modification time)."""
    import fsspec

    memory, folder = fsspec.filesystem("memory"), f"/tasks43-{uuid.uuid4().hex}"
    memory.pipe_file(f"{folder}/a.jsonl", b'{"question": "q0"}\n')
    try:
        task = _template_task(f"memory:/{folder}/a.jsonl", data_source="remote")
        assert _questions(_build(tmp_path, task)) == ["Q: q0"]
        memory.pipe_file(f"{folder}/a.jsonl", b'{"question": "remote edit"}\n')
        assert _questions(_build(tmp_path, task)) == ["Q: remote edit"]
    finally:
        memory.rm(folder, recursive=True)


def test_a_hub_dataset_is_keyed_by_its_revision_and_its_build_says_so(caplog):
    """Issue 43 item 1: a hub id cannot be checked offline; the key holds the revision given (a
    new revision rebuilds) and building one logs that it is built once per revision."""
    import logging

    hub = {"path": "openai/gsm8k", "name": "main", "revision": "abc123"}
    assert input_files("t", hub, None) == [["hub", "openai/gsm8k", "abc123"]]
    with caplog.at_level(logging.INFO, logger="generation_core.inputs.task_cache"):
        log_hub_build("data.train_tasks[0]", {"path": "openai/gsm8k"})
        log_hub_build("data.train_tasks[1]", {"path": "json", "data_files": "x.jsonl"})
    assert [record.getMessage() for record in caplog.records] == [
        "data.train_tasks[0]: building hub dataset openai/gsm8k at revision (none given: the latest, read once); it is "
        "built once per revision (set loading_params.revision to a commit to pin it, or to a new one to rebuild)"
    ]


@pytest.mark.timeout(120)
def test_a_cached_file_edited_by_hand_is_rebuilt(tmp_path):
    """Issue 43 item 1 / audit #15: a built file's sha256 is kept beside it; a file whose bytes
    no longer match (edited by hand) is rebuilt from the source, not trusted."""
    task = _template_task(_jsonl(tmp_path / "data.jsonl", [{"question": "real"}]))
    [(rows, url)] = _build(tmp_path, task)
    original = Path(url).read_bytes()
    assert json.loads(Path(f"{url}.json").read_text()) == {"sha256": hashlib.sha256(original).hexdigest(), "rows": 1}
    write_parquet(Path(url), [{**rows[0], "prompt": [{"role": "user", "content": "Q: forged"}]}])
    [(rows, again)] = _build(tmp_path, task)
    assert again == url and [row["prompt"][-1]["content"] for row in rows] == ["Q: real"]
    assert Path(url).read_bytes() == original


@pytest.mark.timeout(120)
def test_chat_messages_content_parts_are_joined_as_text(tmp_path):
    """Issue 43 item 2 / audit #5: OpenAI-style text parts become their joined text, not the
    Python repr of the list."""
    parts = [{"type": "text", "text": "What is "}, {"type": "text", "text": "2+2?"}]
    rows = [{"messages": [{"role": "user", "content": parts}]}, {"messages": [{"role": "user", "content": "hi"}]}]
    [(built, _)] = _build(tmp_path, _chat_task(_jsonl(tmp_path / "msgs.jsonl", rows)))
    assert [row["prompt"] for row in built] == [
        [{"role": "user", "content": "What is 2+2?"}],
        [{"role": "user", "content": "hi"}],
    ]


IMAGE_PARTS = [{"type": "text", "text": "see"}, {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]
TOOL_CALLS = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("message", "refusal"),
    [
        (
            {"role": "system", "content": None},
            "messages[0].content is null; fix the row or leave it out of the dataset",
        ),
        (
            {"role": "user", "content": IMAGE_PARTS},
            "messages[0].content[1] is a 'image_url' part; only text parts ({'type': 'text', 'text': ...}) are "
            "supported; fix the row or leave it out of the dataset",
        ),
        (
            {"role": "assistant", "content": None, "tool_calls": TOOL_CALLS},
            "messages[0] has tool_calls, which a prompt of text messages would drop; give text messages",
        ),
    ],
)
def test_chat_messages_that_are_not_text_are_refused_naming_task_and_row(tmp_path, message, refusal):
    """Issue 43 item 2 / audit #5: null content, a non-text part or a tool call is refused in one
    line naming the task and the row (0-based), never written as 'None' or a repr."""
    second = [message, {"role": "user", "content": "hi"}]
    rows = [{"messages": [{"role": "user", "content": "fine"}]}, {"messages": second}]
    with pytest.raises(GenrunError) as raised:
        _build(tmp_path, _chat_task(_jsonl(tmp_path / "msgs.jsonl", rows)))
    assert str(raised.value) == f"data.train_tasks[0] row 1: {refusal}"
    assert not (tmp_path / "cache").exists() or not os.listdir(tmp_path / "cache"), "nothing is cached"


@pytest.mark.parametrize(
    ("template", "refusal"),
    [
        ("Q: {} {question}", "the positional field {} names no column; name a column instead, e.g. {question}"),
        ("Q: {0}", "the positional field {0} names no column; name a column instead, e.g. {question}"),
        (
            "Q: {question",
            "'Q: {question' is not a format string (expected '}' before end of string); name columns as {column}, "
            "write a literal brace twice",
        ),
    ],
)
def test_a_template_with_a_positional_field_is_refused_at_check_time(tmp_path, template, refusal):
    """Issue 43 item 3 / audit #10: `{}`/`{0}` (no column fills them) and a broken template are
    refused in one line when the tasks are read, before any dataset loads (it crashed with an
    IndexError traceback mid-build)."""
    cfg = OmegaConf.create({"data": {"train_tasks": [_template_task(tmp_path / "absent.jsonl", template)]}})
    with pytest.raises(GenrunError) as raised:
        task_configs(cfg)
    assert str(raised.value) == f"data.train_tasks[0].prompt_format.prompt_template: {refusal}"


@pytest.mark.parametrize(
    "template", ["Q: {question.upper}", "Q: {question[0]}", "Q: {meta[topic]}", "{question:{width.x}}"]
)
def test_a_template_field_with_attribute_or_index_access_is_refused_at_check_time(tmp_path, template):
    """Audit 2026-11-28 #6: `{question.upper}` built a method's repr (with a memory address) into
    the prompt and the cache, `{question[0]}` one character. A field names a column whole: such a
    field is refused in one line when the tasks are read, as a positional field is."""
    cfg = OmegaConf.create({"data": {"train_tasks": [_template_task(tmp_path / "absent.jsonl", template)]}})
    field = template.split("{")[-1].split("}")[0]
    column = field.split(".")[0].split("[")[0]
    with pytest.raises(GenrunError) as raised:
        task_configs(cfg)
    assert str(raised.value) == (
        f"data.train_tasks[0].prompt_format.prompt_template: the field {{{field}}} reads an attribute or an item of "
        f"column {column!r}, which a prompt does not take; name the column alone, e.g. {{{column}}}, or build the text "
        "in a custom_cls build_row"
    )


@pytest.mark.parametrize("listed", ["inline", "[]\n", "", "# - loading_params: {path: json}\n"])
def test_a_task_list_with_no_task_is_refused(tmp_path, listed):
    """Audit 2026-11-28 #2 and #18: `data.train_tasks=[]` or a file listing no task (`[]`, 0 bytes,
    every entry commented out) generated the bundled demo prompts as if they were the tasks (the
    0-byte file was refused for a missing loading_params.path). Refused: the file lists no tasks."""
    from generation_core.config.bundled import BUNDLED_PROMPTS
    from generation_core.inputs.task_build import resolve_train_tasks

    if listed == "inline":
        tasks, named = [], "data.train_tasks"
    else:
        (tmp_path / "tasks.yaml").write_text(listed)
        tasks = str(tmp_path / "tasks.yaml")
        named = f"data.train_tasks={tasks!r}"
    cfg = OmegaConf.create(
        {"data": {"train_tasks": tasks, "train_files": str(BUNDLED_PROMPTS), "prompt_key": "prompt"}}
    )
    with pytest.raises(GenrunError) as raised:
        resolve_train_tasks(cfg, str(BUNDLED_PROMPTS))
    assert (
        str(raised.value)
        == f"{named} lists no tasks; list at least one task, or unset data.train_tasks to read data.train_files"
    )


@pytest.mark.timeout(120)
def test_chat_messages_follow_the_batch_readers_role_rule_and_keep_name(tmp_path):
    """Audit 2026-11-28 #7: tasks' chat_messages took any role (`banana`, a `tool` message with no
    call before it) and dropped `name`, where the OpenAI batch reader refuses such roles and keeps
    `name`. One rule now (chat_content.prompt_message): developer is read as system, name kept."""
    rows = [
        {"messages": [{"role": "developer", "content": "Be fair."}, {"role": "user", "content": "x", "name": "bob"}]},
        {"messages": [{"role": "user", "content": "y"}]},
    ]
    [(built, _)] = _build(tmp_path, _chat_task(_jsonl(tmp_path / "named.jsonl", rows)))
    assert [row["prompt"] for row in built] == [
        [{"role": "system", "content": "Be fair.", "name": None}, {"role": "user", "content": "x", "name": "bob"}],
        [{"role": "user", "content": "y", "name": None}],
    ]
    for role in ("banana", "tool"):
        rows = [{"messages": [{"role": "user", "content": "x"}, {"role": role, "content": "y"}]}]
        with pytest.raises(GenrunError) as raised:
            _build(tmp_path, _chat_task(_jsonl(tmp_path / f"{role}.jsonl", rows)))
        assert str(raised.value) == (
            f"data.train_tasks[0] row 0: messages[1].role {role!r} is not one a chat template renders; use system, "
            "developer, user or assistant"
        )


@pytest.mark.timeout(120)
def test_a_null_template_field_is_refused_naming_task_and_row(tmp_path):
    """Issue 43 items 2-3 / audit #10: a null column a template reads is refused in one line, not
    written into the prompt as the text 'None'."""
    nulls = _jsonl(tmp_path / "nulls.jsonl", [{"question": "real q", "topic": "a"}, {"question": None, "topic": "b"}])
    with pytest.raises(GenrunError) as raised:
        _build(tmp_path, _template_task(nulls, "Q: {question} ({topic})"))
    assert str(raised.value) == (
        "data.train_tasks[0] row 1: {question} of prompt_template is null; fill it or leave the row out of the dataset"
    )


BROKEN_TASK = """
from generation_core.inputs.tasks import Task


class Fragile(Task):
    def build_row(self, row, index):
        built = super().build_row(row, index)
        built["reward_model"] = {"style": "rule", "ground_truth": row["answer"].split("####")[1]}
        return built
"""


@pytest.mark.timeout(300)
def test_a_build_row_error_is_one_line_exit_2_and_nothing_written(tmp_path, model_dir, capsys):
    """Issue 43 item 3 / audit #10: an exception in a custom class's build_row is one line naming
    the task and row (the traceback goes to the debug log), exit 2, before any model loads, with
    no output folder and nothing cached."""
    rows = [{"question": "a", "answer": "#### 1"}, {"question": "b", "answer": "no marks"}]
    data = _jsonl(tmp_path / "data.jsonl", rows)
    (tmp_path / "fragile.py").write_text(BROKEN_TASK)
    tasks = (
        f"data.train_tasks=[{{loading_params:{{path:json,data_files:'{data}'}},"
        "prompt_format:{prompt_template:'{question}'},"
        f"data_source:fragile,custom_cls:{{path:'{tmp_path / 'fragile.py'}',name:Fragile}}}}]"
    )
    out = tmp_path / "run"
    argv = [
        tasks,
        f"data.task_cache_dir={tmp_path / 'cache'}",
        f"trainer.default_local_dir={out}",
        f"actor_rollout_ref.model.path={model_dir}",
        "actor_rollout_ref.rollout.name=instant",
        "generation.show_progress=false",
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if line.startswith("genrun: error:")] == [
        "genrun: error: data.train_tasks[0] row 1: Fragile.build_row raised IndexError: list index out of range; "
        "fix the task class or the row"
    ]
    assert "Traceback" not in err and "Loading weights" not in err
    assert not out.exists() and not (tmp_path / "cache").exists()
