"""The numbers and labels a run's last lines, its report and its dataset card show (issue 51
items 2 and 3): the agent loops the rows ran (not the config's default), the rewards line, the
time split said to be a sum over the trajectories, the instant engine's boot words. One
instant-engine run in this process, no Ray."""

from __future__ import annotations

import re

import numpy as np
import pytest

from flows.run_command import print_summary
from generation_core.driver.publish import publish_run
from generation_core.engines.instant import InstantEngine, InstantSettings
from generation_core.exports.export import export_run
from generation_core.exports.export_options import ExportOptions
from generation_core.inputs.shard_rows import DatasetPrompts
from generation_core.outputs.finish import finish_run
from generation_core.outputs.ledger import ledger_lines
from generation_core.outputs.summary import reward_figures, reward_line
from generation_core.preflight.preflight import preflight
from generation_core.report.html import REPORT_FILE
from generation_core.shard.rewards import RewardScorer
from generation_core.shard.streaming import StreamingWorker
from tests.conftest import write_parquet
from tests.shard_runs import run_shard

pytestmark = pytest.mark.timeout(240)

# Prompt 0 scores 1.0, the others 0.0 (two samples each).
REWARD = "def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):\n    return float(ground_truth == 'yes')\n"


def _rows() -> list[dict]:
    """Three prompts: the first two name tool_agent (as the tool_calling example's rows do), the third none."""
    rows = []
    for index in range(3):
        row = {
            "data_source": "test/loops",
            "prompt": [{"role": "user", "content": f"Question {index}?"}],
            "ability": "chat",
            "reward_model": {"style": "rule", "ground_truth": "yes" if index == 0 else "no"},
            "extra_info": {"split": "test", "index": index},
            "agent_name": "tool_agent" if index < 2 else None,
        }
        rows.append(row)
    return rows


@pytest.fixture(scope="module")
def finished(tmp_path_factory, model_dir):
    from verl.utils import hf_tokenizer

    base = tmp_path_factory.mktemp("labels")
    reward = base / "reward.py"
    reward.write_text(REWARD)
    plan = preflight(
        [
            f"data.train_files={write_parquet(base / 'prompts.parquet', _rows())}",
            f"trainer.default_local_dir={base / 'run'}",
            f"actor_rollout_ref.model.path={model_dir}",
            "actor_rollout_ref.rollout.name=instant",
            "actor_rollout_ref.rollout.n=2",
            f"reward.custom_reward_function.path={reward}",
            "data.max_prompt_length=64",
            "data.max_response_length=16",
            "generation.show_progress=false",
            "trainer.logger=[]",
        ]
    )
    plan.claim_folder()
    tokenizer = hf_tokenizer(str(model_dir))
    [shard] = plan.shards
    prompts = DatasetPrompts.for_shard(plan.cfg, plan.dataset, shard, tokenizer)
    engine = InstantEngine(InstantSettings(prompt_length=64, response_length=16, eos_token_id=tokenizer.eos_token_id))
    worker = StreamingWorker(plan.cfg, engine, RewardScorer.from_config(plan.cfg, tokenizer))
    try:
        marker = run_shard(plan.cfg, shard, plan.folder, prompts, worker)
    finally:
        worker.shutdown()
    summary = finish_run(plan, [marker], 2.0)
    summary = dict(summary, published=publish_run(plan.cfg, plan.folder, summary, settings=plan.settings))
    return plan, summary


def test_the_report_and_the_card_name_the_loops_the_rows_ran(finished, tmp_path):
    """Issue 51 item 3: both said "single_turn_agent" (the config's default) for rows that ran tool_agent."""
    plan, _ = finished
    page = plan.folder.read_bytes(REPORT_FILE).decode()
    assert re.search(r"<dt>agent loop</dt><dd>([^<]*)</dd>", page).group(1) == "tool_agent (4), single_turn_agent (2)"
    export_run(plan.folder.url, str(tmp_path / "sft.parquet"), ExportOptions())
    card = (tmp_path / "README.md").read_text()
    assert "| agent loop | tool_agent (4), single_turn_agent (2) |" in card, card


def test_the_summary_says_the_rewards_and_what_the_time_split_adds_up(finished, capsys):
    """Issue 51 item 2: a run with rewards printed no reward line, and "time split: decode 2240.6 s"
    in a 156 s run did not say that it adds up every trajectory's own seconds."""
    plan, summary = finished
    assert summary["published"]["rewards"] == {"trajectories": 6, "scored": 6, "mean": 0.3333, "max": 1.0, "at_max": 2}
    print_summary(summary, plan)
    out = capsys.readouterr().out
    assert "\nrewards:       6 scored, mean 0.333, 2 at 1.0 (the highest)\n" in out, out
    assert re.search(r"\ntime split: .* \(summed over 6 trajectories\)\n", out), out
    # Issue 51 item 4: the terminal says when the W&B artifact was logged.
    print_summary(dict(summary, published=dict(summary["published"], wandb_artifact="trajectories-x")), plan)
    assert "\nW&B artifact:  trajectories-x logged (trainer.project_name=genrun)\n" in capsys.readouterr().out


def test_reward_figures_count_the_scored_ones_only():
    rewards = np.array([0.5, np.nan, 0.25, 0.5])
    figures = reward_figures(rewards)
    assert figures == {"trajectories": 4, "scored": 3, "mean": 0.4167, "max": 0.5, "at_max": 2}
    assert reward_line(figures) == "3 of 4 scored, mean 0.417, 2 at 0.5 (the highest)"
    assert reward_figures(np.array([np.nan])) is None


def test_the_time_split_of_an_older_manifest_still_says_it_is_a_sum():
    ledger = {
        "replicas": 1,
        "wall_seconds": 156.0,
        "replica_seconds": 156.0,
        "gpus_per_replica": 0,
        "time_split_seconds": {"decode": 2240.6, "storage": 1.2},
    }
    assert (
        ledger_lines(ledger, 48)[1]
        == "time split:    decode 2240.6 s (100%), storage 1.2 s (0%) (summed over 48 trajectories)"
    )
    assert ledger_lines(ledger)[1].endswith("(summed over trajectories)")


def test_the_instant_engine_is_not_said_to_load_a_model(finished):
    """Issue 51 item 3: the instant engine loads no model, yet the wait said "loading the model"."""
    from generation_core.config.layout import resolve_layout
    from generation_core.driver.run_driver import boot_words

    plan, _ = finished
    assert boot_words(resolve_layout(plan.cfg)) == (
        "starting 1 instant replica(s) on the CPU (no model to load), then the first requests"
    )


@pytest.mark.parametrize(
    "name", ["genrun_replica_3f2a9c1b_0", "http://10.0.0.5:8000/v1", "abcdefghijklmnopqrstuvwxyz0123456789"]
)
def test_the_busy_idle_plot_labels_each_replica_with_its_whole_name(name):
    """Issue 51 item 3: the replica timeline cut each name at 24 characters."""
    from generation_core.report.plots import replica_label

    label = replica_label(name)
    assert label.replace("\n", "") == name
    assert max(len(line) for line in label.splitlines()) <= 20
