"""Tasks instead of preprocessing scripts (issue 36, item 0) and the rl-prompts export (item 5).

Tasks are built offline from a local Parquet file and from a dataset saved with `save_to_disk`;
a custom task class adds the ground truth. The built files are cached (a second preflight builds
nothing), enter the fingerprint by content (and the class by its source), and a bad task is
refused in one line. A run of the instant engine over the built tasks, scored by a reward whose
pass rate per prompt is known, exports one row per prompt with its pass rate, which verl's
RLHFDataset reads."""

from __future__ import annotations

import asyncio
import os

import pyarrow.parquet as pq
import pytest
from omegaconf import OmegaConf

from flows.cli import main
from generation_core.engines.instant import InstantEngine, InstantSettings
from generation_core.errors import GenrunError
from generation_core.inputs.shard_rows import ShardPrompts
from generation_core.plan.preflight import preflight
from generation_core.shard.job import run_shard_with_worker
from generation_core.shard.rewards import RewardScorer
from generation_core.shard.streaming import StreamingWorker
from tests.conftest import write_parquet

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
REWARD = '''
import hashlib


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    if ground_truth == "yes":
        return 1.0
    if ground_truth == "no":
        return 0.0
    return float(hashlib.sha256(solution_str.encode()).digest()[0] % 2)
'''


@pytest.fixture(scope="module")
def task_inputs(tmp_path_factory):
    import datasets

    base = tmp_path_factory.mktemp("task-inputs")
    write_parquet(base / "questions.parquet", [{"question": f"What is {i} + {i}?", "answer": f"#### {'yes' if i % 3 == 0 else 'no' if i % 3 == 1 else 'half'}"} for i in range(6)])
    saved = datasets.DatasetDict({
        "train": datasets.Dataset.from_dict({"messages": [[{"role": "user", "content": f"Say {word}."}] for word in ("hi", "bye")], "topic": ["a", "b"]}),
        "test": datasets.Dataset.from_dict({"messages": [[{"role": "user", "content": "unused"}]], "topic": ["c"]}),
    })
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
        _tasks(base), f"data.task_cache_dir={tmp_path / 'cache'}", f"trainer.default_local_dir={tmp_path / 'run'}",
        f"actor_rollout_ref.model.path={model_dir}", "actor_rollout_ref.rollout.name=instant", f"actor_rollout_ref.rollout.n={ROLLOUT_N}",
        "data.max_prompt_length=64", "data.max_response_length=16", "generation.show_progress=false",
        "generation.sample_seed=7", f"reward.custom_reward_function.path={base / 'reward.py'}", *extra,
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
    moved = preflight([f"data.train_tasks={tmp_path / 'tasks.yaml'}", *_overrides(task_inputs, tmp_path, model_dir, f"data.task_cache_dir={tmp_path / 'cache2'}", f"trainer.default_local_dir={tmp_path / 'run2'}")[1:]])
    assert moved.fingerprint == plan.fingerprint and list(moved.cfg.data.train_files) != files

    # The task class's source is in the key and the fingerprint: an edit rebuilds, another run.
    custom = task_inputs / "custom_task.py"
    original = custom.read_text()
    try:
        custom.write_text(original.replace('.strip()}', '.strip().upper()}'))
        edited = preflight(_overrides(task_inputs, tmp_path, model_dir, f"trainer.default_local_dir={tmp_path / 'run3'}"))
    finally:
        custom.write_text(original)
    assert edited.fingerprint != plan.fingerprint and list(edited.cfg.data.train_files)[0] != files[0]
    assert pq.read_table(list(edited.cfg.data.train_files)[0]).to_pylist()[0]["reward_model"]["ground_truth"] == "YES"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"template": "Q: {questoin}"}, "data.train_tasks[0].prompt_format.prompt_template: unknown column 'questoin'; the dataset's columns: question, answer"),
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
        preflight([*_overrides(task_inputs, tmp_path, model_dir), f"data.train_files={task_inputs / 'questions.parquet'}"])


def test_rl_prompts_export_gives_pass_rates_that_verls_dataset_reads(task_inputs, tmp_path, model_dir, capsys):
    from verl.utils import hf_tokenizer
    from verl.utils.dataset.rl_dataset import RLHFDataset

    from generation_core.outputs.rl_prompts import prompt_rewards
    from generation_core.store.part_repair import committed_parts

    plan = preflight(_overrides(task_inputs, tmp_path, model_dir))
    plan.claim_folder()
    tokenizer = hf_tokenizer(str(model_dir))
    [shard] = plan.shards
    prompts = ShardPrompts.for_shard(plan.cfg, plan.dataset, shard, tokenizer)
    worker = StreamingWorker(plan.cfg, InstantEngine(InstantSettings(prompt_length=64, response_length=16, eos_token_id=tokenizer.eos_token_id)), RewardScorer.from_config(plan.cfg, tokenizer))
    try:
        manifest = asyncio.run(run_shard_with_worker(plan.cfg, shard, plan.folder, prompts, worker))
    finally:
        worker.shutdown()
    assert manifest.num_trajectories == 8 * ROLLOUT_N
    committed = {index: rewards.rewards for index, rewards in prompt_rewards(plan.folder, committed_parts(plan.folder)).items()}
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
        assert (info["pass_rate"], info["num_samples"], info["num_passed"]) == (rates[info["index"]], ROLLOUT_N, sum(r > 0 for r in rewards))
        assert (info["reward_min"], info["reward_max"], info["reward_mean"]) == (min(rewards), max(rewards), sum(rewards) / ROLLOUT_N)
    # The original rows, unchanged but for extra_info.
    source = pq.read_table(list(plan.cfg.data.train_files)[0]).to_pylist()
    assert {k: v for k, v in rows[0].items() if k != "extra_info"} == {k: v for k, v in source[0].items() if k != "extra_info"}

    band = tmp_path / "band.parquet"
    assert main(["export", str(tmp_path / "run"), str(band), "--layout", "rl-prompts", "--pass-rate", "0.01", "0.99"]) == 0
    kept = sorted(index for index, rate in rates.items() if 0.01 <= rate <= 0.99)
    assert [row["extra_info"]["index"] for row in pq.read_table(band).to_pylist()] == kept
    assert f"exported {len(kept)} of 8 prompts" in capsys.readouterr().out

    # verl's RLHFDataset reads the export as training data.
    cfg = plan.cfg.data.copy()
    cfg.train_files = [str(out)]
    dataset = RLHFDataset([str(out)], tokenizer, cfg, processor=None, max_samples=-1)
    assert len(dataset) == 8
    assert dataset[1]["extra_info"]["pass_rate"] == 0.0 and dataset[0]["reward_model"]["ground_truth"] == "yes"

    assert main(["export", str(tmp_path / "run"), str(band), "--layout", "rl-prompts", "--pass-rate", "0.9", "0.1"]) == 2
    assert main(["export", str(tmp_path / "run"), str(band), "--pass-rate", "0", "1"]) == 2
