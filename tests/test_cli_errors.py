"""Bad input gets one clear line on stderr and exit code 2, before any model loads or any
output is written."""

import pytest

from tests.conftest import chat_rows, run_genrun, write_parquet

pytestmark = pytest.mark.timeout(300)


def _bad_inputs(tmp_path):
    no_column = write_parquet(tmp_path / "no_column.parquet", [{"question": "hi", "extra_info": {"index": 0}}])
    not_chat = write_parquet(tmp_path / "not_chat.parquet", [{"prompt": "hi", "extra_info": {"index": 0}}])
    rows = chat_rows(2)
    rows[0]["extra_info"] = {"split": "x"}
    no_index = write_parquet(tmp_path / "no_index.parquet", rows)
    import pyarrow as pa
    import pyarrow.parquet as pq

    empty = tmp_path / "empty.parquet"
    pq.write_table(pa.Table.from_pylist(chat_rows(1)).slice(0, 0), empty)
    good = write_parquet(tmp_path / "good.parquet", chat_rows(3))
    rows = chat_rows(2)
    rows[0]["agent_name"] = "my_loop"
    with_agent = write_parquet(tmp_path / "with_agent.parquet", rows)
    bad_loops = tmp_path / "loops.yaml"
    bad_loops.write_text("- name: broken\n  _target_: nowhere.Loop\n")
    bad_tools = tmp_path / "tools.yaml"
    bad_tools.write_text("tools:\n  - class_name: [not, a, class\n")
    reward = tmp_path / "reward.py"
    reward.write_text("def compute_score(**kwargs):\n    return 0.0\n")
    return [
        ([f"data.train_files={tmp_path / 'missing.parquet'}"], "does not exist"),
        ([f"data.train_files={no_column}"], "has no column 'prompt'"),
        ([f"data.train_files={not_chat}"], "not a list of chat messages"),
        ([f"data.train_files={empty}"], "dataset is empty"),
        ([f"data.train_files={no_index}"], "extra_info.index is missing"),
        ([f"data.train_files={good}", "generation.max_inflght=2"], "did you mean 'generation.max_inflight'"),
        ([f"data.train_files={good}", f"actor_rollout_ref.model.path={tmp_path / 'no_model'}"], "model path .* does not exist"),
        ([f"data.train_files={good}", "generation.num_shards=4"], "num_shards=4 is more than the 3 prompts"),
        ([f"data.train_files={good}", "data.max_response_length=9000"], "exceed the model's context"),
        ([f"data.train_files={good}", "actor_rollout_ref.rollout.name=nope"], "unknown actor_rollout_ref.rollout.name='nope'; known engines: .*hf"),
        ([f"data.train_files={good}", "actor_rollout_ref.rollout.agent.default_agent_loop=tool_agnet"], "unknown agent loop 'tool_agnet' .*registered agent loops: (.*, )?self_refine, single_turn_agent, tool_agent"),
        ([f"data.train_files={with_agent}"], "unknown agent loop 'my_loop' .*registered agent loops:"),
        ([f"data.train_files={good}", f"actor_rollout_ref.rollout.agent.agent_loop_config_path={bad_loops}"], "agent loop 'broken' names 'nowhere.Loop', which cannot be imported"),
        ([f"data.train_files={good}", f"actor_rollout_ref.rollout.multi_turn.tool_config_path={bad_tools}"], "tool config .*tool_config_path=.* does not load"),
        ([f"data.train_files={good}", f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tmp_path / 'none.yaml'}"], "tool_config_path=.* does not exist"),
        ([f"data.train_files={good}", f"reward.custom_reward_function.path={tmp_path / 'none.py'}"], "reward.custom_reward_function.path=.* does not exist"),
        ([f"data.train_files={good}", f"reward.custom_reward_function.path={reward}", "reward.custom_reward_function.name=score"], "has no function 'score'"),
        ([f"data.train_files={good}", "generation.max_failed_fraction=2"], "invalid generation.max_failed_fraction=2"),
    ]


def _refused_in_one_line(result_code, stderr, args, message):
    import re

    errors = [line for line in stderr.splitlines() if line.startswith("genrun: error:")]
    assert result_code == 2, (args, stderr[-2000:])
    assert len(errors) == 1 and re.search(message, errors[0]), (args, stderr[-2000:])
    assert "Traceback" not in stderr
    assert "Loading weights" not in stderr, "no model may load before the input is checked"


def test_bad_inputs_get_one_line_before_any_work(tmp_path, model_dir, capsys):
    """Every bad input through the CLI's own entry function, in this process (a subprocess per
    input would spend most of the test importing torch and verl again)."""
    import ray

    from generation_core.cli import main

    for args, message in _bad_inputs(tmp_path):
        out = tmp_path / "out"
        code = main([*args, f"trainer.default_local_dir={out}"])
        _refused_in_one_line(code, capsys.readouterr().err, args, message)
        assert not out.exists(), "a refused run writes nothing"
        assert not ray.is_initialized(), "refused before Ray (and any replica) started"


def test_the_console_script_refuses_bad_input_in_one_line(tmp_path, model_dir):
    """The same contract seen by a user at the shell: the installed command, its exit code."""
    cases = [case for case in _bad_inputs(tmp_path) if any(word in case[1] for word in ("does not exist", "did you mean", "unknown agent loop 'tool_agnet'"))]
    assert len(cases) >= 3
    for args, message in cases[:3]:
        out = tmp_path / "out"
        result = run_genrun([*args, f"trainer.default_local_dir={out}"], timeout=120)
        _refused_in_one_line(result.returncode, result.stderr, args, message)
        assert not out.exists(), "a refused run writes nothing"
