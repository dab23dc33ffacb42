"""Bad inputs and the refusal each must get: `genrun: error: <line matching regex>`, exit code 2,
before any model loads, with the output folder untouched.

`bad_input_cases(tmp_path)` builds the inputs under tmp_path and returns (overrides, regex)
pairs. A case that names its own trainer.default_local_dir points at a folder that already
exists (a different run, a path under a file); the others get one from the caller.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from generation_core.store.run_folder import FOLDER_FORMAT
from tests.conftest import chat_rows, write_parquet

OUTPUT_KEY = "trainer.default_local_dir="


def bad_input_cases(tmp_path: Path) -> list[tuple[list[str], str]]:
    no_column = write_parquet(tmp_path / "no_column.parquet", [{"question": "hi", "extra_info": {"index": 0}}])
    not_chat = write_parquet(tmp_path / "not_chat.parquet", [{"prompt": "hi", "extra_info": {"index": 0}}])
    rows = chat_rows(2)
    rows[0]["extra_info"] = {"split": "x"}
    no_index = write_parquet(tmp_path / "no_index.parquet", rows)
    rows = chat_rows(3)
    rows[1]["prompt"] = [{"role": "system", "content": None}, {"role": "user", "content": "hi"}]
    null_content = write_parquet(tmp_path / "null_content.parquet", rows)
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
    # Data in the wrong format or unreadable.
    csv_named_parquet = tmp_path / "csv_inside.parquet"
    csv_named_parquet.write_text("prompt,index\nhello,0\n")
    csv_file = tmp_path / "prompts.csv"
    csv_file.write_text("prompt,index\nhello,0\n")
    # Root reads any file whatever its mode: a directory under a data file's name is what
    # honestly cannot be read as one.
    directory_named_parquet = tmp_path / "folder.parquet"
    directory_named_parquet.mkdir()
    # Several files: one schema, ids unique across them.
    other_schema = write_parquet(
        tmp_path / "other_schema.parquet", [dict(row, ability=1) for row in chat_rows(2, first_index=10)]
    )
    same_ids = write_parquet(tmp_path / "same_ids.parquet", chat_rows(2, first_index=1))
    # Model folders missing a piece (checked before anything loads them).
    no_config = tmp_path / "model_without_config"
    no_config.mkdir()
    (no_config / "tokenizer.json").write_text("{}")
    no_tokenizer = tmp_path / "model_without_tokenizer"
    no_tokenizer.mkdir()
    (no_tokenizer / "config.json").write_text(json.dumps({"model_type": "llama", "max_position_embeddings": 2048}))
    # Output that cannot be created (as root: a folder under a regular file), or that holds another run.
    a_file = tmp_path / "a_file"
    a_file.write_text("not a folder")
    other_run = tmp_path / "other_run"
    (other_run / "shards" / "shard-00000").mkdir(parents=True)
    (other_run / "run.json").write_text(
        json.dumps(
            {
                "fingerprint": "f" * 64,
                "fingerprint_version": FOLDER_FORMAT,
                "shards": [{"name": "shard-00000", "range": [0, 3]}],
            }
        )
    )
    (other_run / "shards" / "shard-00000" / "part-00000.parquet").write_bytes(b"PAR1 an earlier run's part PAR1")
    return [
        ([f"data.train_files={tmp_path / 'missing.parquet'}"], "does not exist"),
        ([f"data.train_files={no_column}"], "has no column 'prompt'"),
        ([f"data.train_files={not_chat}"], "not a list of chat messages"),
        ([f"data.train_files={empty}"], "dataset is empty"),
        # Audit 2026-11-28 #1-#2: verl's filter dropped this row as overlong; [] read the demo prompts.
        (
            [f"data.train_files={null_content}"],
            r"data file .*null_content.parquet row 1 \(extra_info.index 1\): prompt\[0\].content is null",
        ),
        (["data.train_tasks=[]"], r"data.train_tasks lists no tasks; list at least one task"),
        ([f"data.train_files={no_index}"], "extra_info.index is missing"),
        ([f"data.train_files={good}", "generation.max_inflght=2"], "did you mean 'generation.max_inflight'"),
        # A key added with + that nothing reads (these ran one shard and the bundled prompts, exit 0).
        (
            [f"data.train_files={good}", "+generation.num_shard=2"],
            r"\+generation.num_shard: no such config key.*did you mean 'generation.num_shards'",
        ),
        (["+train_tasks=[a.parquet]"], r"\+train_tasks: no such config key.*'data.train_tasks'"),
        # Issue 44: a key the cuts removed (the ETA benchmarks' long tail) is refused like any unknown one.
        (
            [f"data.train_files={good}", "actor_rollout_ref.rollout.engine_kwargs.instant.delay_sigma=1.0"],
            r"unknown config key 'actor_rollout_ref.rollout.engine_kwargs.instant.delay_sigma'",
        ),
        (
            [f"data.train_files={good}", f"actor_rollout_ref.model.path={tmp_path / 'no_model'}"],
            "model path .* does not exist",
        ),
        ([f"data.train_files={good}", "generation.num_shards=4"], "num_shards=4 is more than the 3 prompts"),
        (
            [f"data.train_files={good}", "data.storage_options.secret=abc"],
            "data.storage_options.secret on the command line would be stored in the Prefect flow run's parameters",
        ),
        ([f"data.train_files={good}", "data.max_response_length=9000"], "exceed the model's context"),
        (
            [f"data.train_files={good}", "actor_rollout_ref.rollout.name=nope"],
            "unknown actor_rollout_ref.rollout.name='nope'; known engines: .*hf",
        ),
        (
            [f"data.train_files={good}", "actor_rollout_ref.rollout.agent.default_agent_loop=tool_agnet"],
            "unknown agent loop 'tool_agnet' .*registered agent loops: (.*, )?single_turn_agent, tool_agent",
        ),
        ([f"data.train_files={with_agent}"], "unknown agent loop 'my_loop' .*registered agent loops:"),
        (
            [f"data.train_files={good}", f"actor_rollout_ref.rollout.agent.agent_loop_config_path={bad_loops}"],
            "agent loop 'broken' names 'nowhere.Loop', which cannot be imported",
        ),
        (
            [f"data.train_files={good}", f"actor_rollout_ref.rollout.multi_turn.tool_config_path={bad_tools}"],
            "tool config .*tool_config_path=.* does not load",
        ),
        (
            [
                f"data.train_files={good}",
                f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tmp_path / 'none.yaml'}",
            ],
            "tool_config_path=.* does not exist",
        ),
        (
            [f"data.train_files={good}", f"reward.custom_reward_function.path={tmp_path / 'none.py'}"],
            "reward.custom_reward_function.path=.* does not exist",
        ),
        (
            [
                f"data.train_files={good}",
                f"reward.custom_reward_function.path={reward}",
                "reward.custom_reward_function.name=score",
            ],
            "has no function 'score'",
        ),
        ([f"data.train_files={good}", "generation.max_failed_fraction=2"], "invalid generation.max_failed_fraction=2"),
        (
            [f"data.train_files={good}", "generation.inflight_share_cap=0"],
            r"invalid generation.inflight_share_cap=0: must be an integer >= 1 \(1: each shard keeps its own max_inflight\)",
        ),
        (
            [f"data.train_files={good}", "generation.gpu_hour_price=-1"],
            r"invalid generation.gpu_hour_price=-1: must be null \(no cost figures\) or the price of one GPU-hour",
        ),
        (
            [f"data.train_files={csv_named_parquet}"],
            r"data file .*csv_inside.parquet cannot be read as parquet .*; data.train_files takes Parquet",
        ),
        ([f"data.train_files={csv_file}"], r"data file .*prompts.csv: unsupported format; use .parquet, .json, .jsonl"),
        (
            [f"data.train_files={directory_named_parquet}"],
            r"data file .*folder.parquet is a directory with no \*.parquet file in it; put the Parquet files there or list the files",
        ),
        (
            [f"data.train_files={tmp_path / 'nowhere' / 'part-*.parquet'}"],
            r"data.train_files pattern .*nowhere/part-\*.parquet matches no file",
        ),
        (
            [f"data.train_files=[{good},{other_schema}]"],
            r"data file .*other_schema.parquet has another schema than .*good.parquet \(column 'ability': int64 here, string there\)",
        ),
        (
            [f"data.train_files=[{good},{same_ids}]"],
            r"data file .*same_ids.parquet row 0: extra_info.index 1 repeats \(also in .*good.parquet row 1\); ids must be unique",
        ),
        (
            [f"data.train_files={good}", "actor_rollout_ref.rollout.n=0"],
            r"invalid actor_rollout_ref.rollout.n=0: must be an integer >= 1",
        ),
        (
            [f"data.train_files={good}", "data.max_prompt_length=-8"],
            r"invalid data.max_prompt_length=-8: must be an integer >= 1",
        ),
        (
            [f"data.train_files={good}", "data.max_response_length=-8"],
            r"invalid data.max_response_length=-8: must be an integer >= 1",
        ),
        (
            [f"data.train_files={good}", "actor_rollout_ref.rollout.response_length=-8"],
            r"invalid actor_rollout_ref.rollout.response_length=-8: must be an integer >= 1",
        ),
        (
            [f"data.train_files={good}", "actor_rollout_ref.rollout.temperature=-0.5"],
            r"invalid actor_rollout_ref.rollout.temperature=-0.5: must be a number >= 0",
        ),
        (
            [f"data.train_files={good}", f"actor_rollout_ref.model.path={no_config}"],
            r"model_without_config has no config.json; set actor_rollout_ref.model.path",
        ),
        (
            [f"data.train_files={good}", f"actor_rollout_ref.model.path={no_tokenizer}"],
            r"model_without_tokenizer has no tokenizer files .*; save the tokenizer there",
        ),
        (
            [f"data.train_files={good}", "data.max_prompt_length=3"],
            r"no prompt left after filtering: all 3 sampled prompts .* are longer than data.max_prompt_length=3 tokens; raise it",
        ),
        (
            [f"data.train_files={good}", f"{OUTPUT_KEY}{a_file / 'out'}"],
            r"cannot create output folder .*a_file/out: .*a_file is a file, not a folder; choose another trainer.default_local_dir",
        ),
        # Inference engines: a GPU engine that is not installed, a layout the GPUs cannot hold,
        # remote servers not given or not answering.
        (
            [f"data.train_files={good}", "actor_rollout_ref.rollout.name=sglang"],
            r"rollout.name=sglang needs the sglang package .*pip install 'genrun\[sglang\]'",
        ),
        (
            [
                f"data.train_files={good}",
                "actor_rollout_ref.rollout.name=vllm",
                "trainer.n_gpus_per_node=2",
                "actor_rollout_ref.rollout.tensor_model_parallel_size=4",
            ],
            r"rollout.name=vllm: 2 GPU\(s\) .*cannot be split into replicas of .* = 4 GPUs",
        ),
        (
            [f"data.train_files={good}", "actor_rollout_ref.rollout.tensor_model_parallel_size=2"],
            r"rollout.name=hf has no model parallelism",
        ),
        (
            [f"data.train_files={good}", "actor_rollout_ref.rollout.name=remote"],
            r"rollout.name=remote needs the servers' base URLs: set actor_rollout_ref.rollout.engine_kwargs.remote.base_urls=",
        ),
        (
            [
                f"data.train_files={good}",
                "actor_rollout_ref.rollout.name=remote",
                "actor_rollout_ref.rollout.engine_kwargs.remote.base_urls=[http://127.0.0.1:9]",
            ],
            r"none of the 1 remote inference server\(s\) answered: http://127.0.0.1:9: .*start them",
        ),
        (
            [f"data.train_files={good}", f"{OUTPUT_KEY}{other_run}"],
            r"output folder .*other_run holds a different run .*To start fresh, set another trainer.default_local_dir .*or delete that folder",
        ),
    ]


def output_folder(args: list[str], default: Path) -> Path:
    """The output folder a case writes to: its own trainer.default_local_dir, else `default`."""
    named = [arg[len(OUTPUT_KEY) :] for arg in args if arg.startswith(OUTPUT_KEY)]
    return Path(named[-1]) if named else default


def folder_contents(folder: Path) -> dict[str, bytes] | None:
    """Every file under `folder` with its bytes (None when the folder does not exist)."""
    if not folder.exists():
        return None
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}
