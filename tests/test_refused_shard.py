"""A shard whose input changed under the run stops it with genrun's one line (issue 43 item 8)."""

from __future__ import annotations

import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.conftest import chat_rows, run_genrun


@pytest.mark.timeout(600)
def test_a_shard_refused_for_a_changed_input_file_prints_one_line_and_no_traceback(tmp_path, model_dir, prefect_server):
    """Issue 43 item 8: a shard refused inside its task for a changed input file (its rows'
    digest no longer the one its first attempt recorded: a GenrunError raised in the shard task)
    was retried twice for nothing, then the run ended with Prefect's flow-engine traceback (~20
    lines) before a one-line error, exit 1. Now the shard task is not retried and the CLI prints
    only genrun's line, exit 2; the traceback stays in the debug log."""
    from verl.utils import hf_tokenizer

    from generation_core.engines.instant import InstantEngine, InstantSettings
    from generation_core.inputs.shard_rows import DatasetPrompts
    from generation_core.preflight.preflight import preflight
    from generation_core.shard.streaming import StreamingWorker
    from generation_core.store.run_folder import COMMITS_DIR
    from tests.shard_runs import run_shard

    # One column of 3 MiB ahead of the ground truths: the file is fingerprinted by samples and
    # its footer holds no statistics, so an in-place edit of one ground truth keeps the
    # fingerprint and only the shard's rows digest can tell (docs/reliability.md, Resume).
    rows = chat_rows(4)
    table = pa.table(
        {
            "pad": ["x" * (3 << 20)] * 4,
            "data_source": [row["data_source"] for row in rows],
            "prompt": [row["prompt"] for row in rows],
            "reward_model": [{"style": "rule", "ground_truth": f"GT{i:02d}"} for i in range(4)],
            "extra_info": [row["extra_info"] for row in rows],
        }
    )
    path = tmp_path / "prompts.parquet"
    pq.write_table(table, path, compression="none", write_statistics=False)
    overrides = [
        f"data.train_files={path}",
        f"trainer.default_local_dir={tmp_path / 'run'}",
        f"actor_rollout_ref.model.path={model_dir}",
        "actor_rollout_ref.rollout.name=instant",
        "data.max_prompt_length=64",
        "data.max_response_length=16",
        "generation.show_progress=false",
        "generation.retry_delay_seconds=30",
    ]
    plan = preflight(overrides)
    plan.claim_folder()
    tokenizer = hf_tokenizer(str(model_dir))
    shard = plan.shards[0]
    worker = StreamingWorker(
        plan.cfg,
        InstantEngine(InstantSettings(prompt_length=64, response_length=16, eos_token_id=tokenizer.eos_token_id)),
    )
    try:
        assert (
            run_shard(
                plan.cfg,
                shard,
                plan.folder,
                DatasetPrompts.for_shard(plan.cfg, plan.dataset, shard, tokenizer),
                worker,
            ).num_trajectories
            == 4
        )
    finally:
        worker.shutdown()
    # The shard as a run killed after its part was committed leaves it: its done record and
    # success marker not yet written.
    shard_dir = tmp_path / "run" / "shards" / shard.name
    (shard_dir / "_SUCCESS.json").unlink()
    records = sorted((shard_dir / COMMITS_DIR).iterdir())
    assert '"kind":"done"' in records[-1].read_text()
    records[-1].unlink()

    data = path.read_bytes()
    assert data.count(b"GT02") == 1
    path.write_bytes(data.replace(b"GT02", b"GT01"))
    assert preflight(overrides).fingerprint == plan.fingerprint, "the same run: only the shard's rows digest tells"

    # The session's Prefect server: a temporary one would add its start and nothing to this test.
    result = run_genrun(overrides, timeout=480, env=prefect_server.env)
    output = result.stdout + result.stderr
    assert result.returncode == 2, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    errors = [line for line in output.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and re.fullmatch(
        rf"genrun: error: the dataset rows of {shard.name} changed since its first attempt "
        rf"\(digest [0-9a-f]{{12}}, recorded [0-9a-f]{{12}} in {re.escape(str(shard_dir / COMMITS_DIR))}\): "
        r"its committed trajectories belong to other prompts\. Restore the dataset, or write to "
        r"another trainer\.default_local_dir",
        errors[0],
    ), output[-3000:]
    assert "Retry" not in output and "retries" not in output, "a changed input is not retried"
