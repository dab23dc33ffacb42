"""The merge pads exactly as verl's AgentLoopWorker: compared with verl's own code on the same outputs."""

import asyncio

import numpy as np
import pytest
import torch
from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput
from verl.protocol import DataProto

from generation_core.config.loading import load_config
from generation_core.outputs.padding import PROVENANCE_KEY, TIMINGS_KEY
from generation_core.shard.streaming import StreamingWorker
from tests.merge_oracles import build_dataproto

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def worker(model_dir):
    cfg = load_config(["data.max_prompt_length=16", "data.max_response_length=12"])
    return StreamingWorker(cfg, llm_client=None)


def _outputs(with_logprobs: bool, with_rewards: bool) -> list[AgentLoopOutput]:
    specs = [
        ([1, 5, 9, 13, 17], [21, 22, 23, 24, 25, 26, 2], [1] * 7, 1.0),
        ([3, 4, 5], [30, 31, 40, 41, 32], [1, 1, 0, 0, 1], 0.5),
        ([7] * 16, [8] * 12, [1] * 12, -2.0),
        ([9, 10], [], [], 0.0),
    ]
    outputs = []
    for i, (prompt, response, mask, reward) in enumerate(specs):
        logprobs = [(-0.1 * (j + 1)) if m else 0.0 for j, m in enumerate(mask)] if with_logprobs else None
        outputs.append(
            AgentLoopOutput(
                prompt_ids=prompt,
                response_ids=response,
                response_mask=mask,
                response_logprobs=logprobs,
                reward_score=reward if (with_rewards or i % 2 == 0) else None,
                num_turns=2 + 2 * (i % 2),
                metrics=AgentLoopMetrics(generate_sequences=0.1 * i),
                extra_fields={
                    "turn_scores": [],
                    "tool_rewards": [0.5] if i == 1 else [],
                    "min_global_steps": None,
                    "max_global_steps": None,
                },
            )
        )
    return outputs


def _kwargs(i: int) -> dict:
    return {
        "data_source": "test",
        "raw_prompt": [{"role": "user", "content": f"q{i}"}],
        "reward_model": {"style": "rule", "ground_truth": str(i)},
        "extra_info": {"index": 100 + i},
        "index": 100 + i,
        "tools_kwargs": {},
        "interaction_kwargs": {},
        "agent_name": "single_turn_agent",
    }


def _assert_equals_verl(merged, expected):
    """Our DataProto against verl's _postprocess output: the same keys (in any order), dtypes,
    shapes and values, non-tensor fields and meta_info."""
    assert sorted(merged.batch.keys()) == sorted(expected.batch.keys())
    for key in expected.batch.keys():
        ours, theirs = merged.batch[key], expected.batch[key]
        assert ours.dtype == theirs.dtype and ours.shape == theirs.shape, key
        assert torch.equal(ours, theirs), key
    # Beside verl's: genrun's own provenance and time split of each trajectory.
    assert sorted(set(merged.non_tensor_batch) - {PROVENANCE_KEY, TIMINGS_KEY}) == sorted(expected.non_tensor_batch)
    for key, theirs in expected.non_tensor_batch.items():
        ours = merged.non_tensor_batch[key]
        assert ours.dtype == theirs.dtype, key
        assert ours.tolist() == theirs.tolist(), key
    assert merged.meta_info == expected.meta_info


@pytest.mark.parametrize("with_logprobs, with_rewards", [(True, True), (False, False)])
def test_merge_equals_verl_postprocess(worker, with_logprobs, with_rewards):
    verl_worker = worker.worker
    kwargs = [_kwargs(i) for i in range(4)]

    async def verl_side():
        return [
            await verl_worker._agent_loop_postprocess(o, False, **kw)
            for o, kw in zip(_outputs(with_logprobs, with_rewards), kwargs, strict=True)
        ]

    padded = asyncio.run(verl_side())
    non_tensor_input = {key: np.fromiter([kw[key] for kw in kwargs], dtype=object, count=4) for key in kwargs[0]}
    expected = verl_worker._postprocess(padded, input_non_tensor_batch=non_tensor_input)

    # Our path: the same agent-loop outputs as unpadded records (as streamed to disk), merged.
    records = [
        worker.record_from_output((kw["index"], 0), out, kw)
        for out, kw in zip(_outputs(with_logprobs, with_rewards), kwargs, strict=True)
    ]
    merged = build_dataproto(
        records, prompt_length=16, response_length=12, pad_token_id=verl_worker.tokenizer.pad_token_id
    )

    assert sorted(merged.batch.keys()) == sorted(expected.batch.keys())
    assert ("rm_scores" in merged.batch.keys()) == with_rewards
    assert ("rollout_log_probs" in merged.batch.keys()) == with_logprobs
    _assert_equals_verl(merged, expected)


def test_reward_extra_keys_that_vary_per_sample_become_columns_with_gaps():
    from generation_core.store.trajectory_record import TrajectoryRecord

    records = [
        TrajectoryRecord(
            0,
            0,
            [1, 2],
            [3, 2],
            [1, 1],
            None,
            1.0,
            2,
            {"index": 0},
            {"reward_extra_info": {"score": 1.0, "acc": True}},
            {},
        ),
        TrajectoryRecord(
            1,
            0,
            [1, 2],
            [4, 2],
            [1, 1],
            None,
            0.0,
            2,
            {"index": 1},
            {"reward_extra_info": {"score": 0.0, "format_error": "no answer"}},
            {},
        ),
    ]
    data = build_dataproto(records, prompt_length=4, response_length=4, pad_token_id=2)
    assert data.meta_info["reward_extra_keys"] == ["score", "acc", "format_error"]
    assert data.non_tensor_batch["score"].tolist() == [1.0, 0.0]
    assert data.non_tensor_batch["acc"].tolist() == [True, None]
    assert data.non_tensor_batch["format_error"].tolist() == [None, "no answer"]


# --- merging a run folder: the column-wise path, chunks, the pickle writer -------------------

import hashlib  # noqa: E402
import pickle  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

from generation_core.outputs.dataproto_pickle import dump_dataproto  # noqa: E402
from generation_core.outputs.merge import merge_run, merge_run_chunked  # noqa: E402
from generation_core.store.folder import StorageFolder  # noqa: E402
from generation_core.store.run_folder import CHUNK_INDEX_FILE, MERGED_FILE, merged_files  # noqa: E402
from generation_core.store.trajectory_record import TrajectoryRecord, records_to_parquet  # noqa: E402
from tests.merge_oracles import load_chunks, read_committed_records  # noqa: E402

PROMPT_LENGTH, RESPONSE_LENGTH, PAD = 12, 10, 2


def _random_records(count: int, seed: int = 0, with_logprobs: bool = True) -> list[TrajectoryRecord]:
    """Varied trajectories: empty and full-length responses, tool tokens (mask 0), reward
    extras whose keys vary per sample, the raw prompt in both field dicts as verl puts it."""
    rng = np.random.default_rng(seed)
    records = []
    for i in range(count):
        p = int(rng.integers(1, PROMPT_LENGTH + 1))
        r = 0 if i % 7 == 3 else (RESPONSE_LENGTH if i % 5 == 0 else int(rng.integers(1, RESPONSE_LENGTH)))
        mask = [int(m) for m in rng.integers(0, 2, r)]
        messages = [{"role": "user", "content": f"question {i}"}]
        info = {"acc": float(i % 2)} if i % 3 else {"acc": 0.0, "format_error": "no answer"}
        records.append(
            TrajectoryRecord(
                index=1000 + i // 2,
                rollout_n=i % 2,
                prompt_ids=[int(t) for t in rng.integers(3, 50000, p)],
                response_ids=[int(t) for t in rng.integers(3, 50000, r)],
                response_mask=mask,
                response_logprobs=[
                    float(v) if m else 0.0 for v, m in zip(rng.normal(-1, 2, r).astype(np.float32), mask, strict=True)
                ]
                if with_logprobs
                else None,
                reward_score=float(rng.normal()),
                num_turns=2 + 2 * (i % 2),
                input_fields={
                    "data_source": "test",
                    "index": 1000 + i // 2,
                    "raw_prompt": messages,
                    "extra_info": {"index": 1000 + i // 2},
                },
                extra_fields={
                    "raw_prompt": messages,
                    "turn_scores": [],
                    "tool_rewards": [0.5] if i % 4 == 1 else [],
                    "reward_extra_info": info,
                },
                metrics={"generate_sequences": float(rng.uniform(0, 3)), "tool_calls": 0.0, "num_preempted": -1},
            )
        )
    return records


def _write_run(folder: StorageFolder, records: list[TrajectoryRecord], parts_of: int = 5, shards: int = 3) -> None:
    """A finished run folder: the records spread over shards in shuffled parts, as shards commit them."""
    from generation_core.inputs.shard_rows import ShardSpec
    from generation_core.store.commit_log import ShardCheckpoint
    from generation_core.store.run_folder import PartEntry

    order = np.random.default_rng(1).permutation(len(records))
    for shard in range(shards):
        spec = ShardSpec(shard, 0, 0)
        mine = [records[i] for i in order[shard::shards]]
        checkpoint = ShardCheckpoint()
        for start in range(0, len(mine), parts_of):
            data = records_to_parquet(mine[start : start + parts_of])
            name = f"batch-{len(checkpoint.parts):05d}-test.parquet"
            folder.put_atomic(f"shards/{spec.name}/{name}", data)
            part = PartEntry(
                name=name,
                count=len(mine[start : start + parts_of]),
                bytes=len(data),
                sha256=hashlib.sha256(data).hexdigest(),
            )
            checkpoint.commit_part(
                folder, spec.name, part, [f"{r.index}:{r.rollout_n}" for r in mine[start : start + parts_of]]
            )


def _assert_same_dataproto(actual, expected, metrics_as_lists=False):
    assert list(actual.batch.keys()) == list(expected.batch.keys())
    for key in expected.batch.keys():
        assert actual.batch[key].dtype == expected.batch[key].dtype, key
        assert torch.equal(actual.batch[key], expected.batch[key]), key
    assert list(actual.non_tensor_batch) == list(expected.non_tensor_batch)
    for key, theirs in expected.non_tensor_batch.items():
        assert actual.non_tensor_batch[key].dtype == theirs.dtype, key
        assert actual.non_tensor_batch[key].tolist() == theirs.tolist(), key
    if metrics_as_lists:
        # DataProto.concat turns the per-trajectory metrics into a dict of lists.
        from verl.utils.py_functional import list_of_dict_to_dict_of_list

        expected_meta = dict(expected.meta_info, metrics=list_of_dict_to_dict_of_list(expected.meta_info["metrics"]))
        assert actual.meta_info == expected_meta
    else:
        assert actual.meta_info == expected.meta_info


def _lengths():
    return dict(prompt_length=PROMPT_LENGTH, response_length=RESPONSE_LENGTH, pad_token_id=PAD)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("with_logprobs", [True, False])
def test_merged_folder_equals_build_dataproto_of_its_records(tmp_path, with_logprobs):
    records = _random_records(41, with_logprobs=with_logprobs)
    folder = StorageFolder(str(tmp_path / "run"))
    _write_run(folder, records)
    committed = read_committed_records(folder)
    assert [r.__dict__ for r in committed] == [r.__dict__ for r in sorted(records, key=lambda r: r.key)]
    # The record-by-record path the merge used to take is the reference for the column-wise one.
    expected = build_dataproto(committed, **_lengths())

    merged = merge_run(folder, **_lengths())
    _assert_same_dataproto(merged, expected)
    with open(tmp_path / "run" / MERGED_FILE, "rb") as handle:
        _assert_same_dataproto(pickle.load(handle), expected)
    assert merged_files(folder) == [MERGED_FILE]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("length_field", ["4 bytes", "8 bytes (blobs of 4 GiB and more)"])
def test_the_low_memory_pickle_loads_as_verls_own_pickle_does(tmp_path, monkeypatch, length_field):
    import generation_core.outputs.dataproto_pickle as dataproto_pickle

    if length_field.startswith("8"):
        monkeypatch.setattr(dataproto_pickle, "_BINBYTES_LIMIT", 0)
    data = build_dataproto(_random_records(9), **_lengths())
    path = tmp_path / "data.pkl"
    with open(path, "wb") as handle:
        size, sha256 = dump_dataproto(data, handle)
    written = path.read_bytes()
    assert size == len(written) and sha256 == hashlib.sha256(written).hexdigest()
    # What a consumer runs: plain pickle (no genrun involved in loading) and verl's loader.
    _assert_same_dataproto(pickle.loads(written), data)
    _assert_same_dataproto(DataProto.load_from_disk(str(path)), data)
    _assert_same_dataproto(pickle.loads(written), pickle.loads(pickle.dumps(data)))
    # Nothing in the file refers to genrun: it loads wherever verl is installed.
    assert b"generation_core" not in written
    if length_field.startswith("8"):
        return  # the rest does not depend on the length field: once is enough (a fresh process takes 10 s)
    loader = (
        f"import pickle, sys; sys.modules['generation_core'] = None; print(len(pickle.load(open({str(path)!r}, 'rb'))))"
    )
    assert (
        subprocess.run([sys.executable, "-c", loader], capture_output=True, text=True, check=True).stdout.split()[-1]
        == "9"
    )


@pytest.mark.timeout(60)
def test_chunks_concatenate_to_the_unchunked_dataproto_and_remerging_leaves_no_stale_chunk(tmp_path):
    records = _random_records(23)
    folder = StorageFolder(str(tmp_path / "run"))
    _write_run(folder, records)
    whole = merge_run(folder, **_lengths())

    merged = merge_run_chunked(folder, chunk_size=4, **_lengths())
    index = folder.read_json(CHUNK_INDEX_FILE)
    assert merged.rows == index["rows"] == 23
    assert [(c["name"], c["rows"], c["first_row"]) for c in index["chunks"]] == [
        (f"trajectories-{i:05d}.pkl", 4 if i < 5 else 3, 4 * i) for i in range(6)
    ]
    assert not folder.exists(MERGED_FILE), "the single-file output of the earlier merge is gone"
    _assert_same_dataproto(load_chunks(folder), whole, metrics_as_lists=True)
    # Each chunk is a plain pickle of its rows.
    with open(tmp_path / "run" / "trajectories-00001.pkl", "rb") as handle:
        second = pickle.load(handle)
    assert second.non_tensor_batch["index"].tolist() == whole.non_tensor_batch["index"].tolist()[4:8]

    merge_run_chunked(folder, chunk_size=10, **_lengths())
    assert sorted(n for n in folder.list("") if n.startswith("trajectories")) == [
        "trajectories-00000.pkl",
        "trajectories-00001.pkl",
        "trajectories-00002.pkl",
        CHUNK_INDEX_FILE,
    ]
    assert [c["rows"] for c in folder.read_json(CHUNK_INDEX_FILE)["chunks"]] == [10, 10, 3]
    _assert_same_dataproto(load_chunks(folder), whole, metrics_as_lists=True)

    merge_run(folder, **_lengths())
    assert merged_files(folder) == [MERGED_FILE]
    assert sorted(n for n in folder.list("") if n.startswith("trajectories")) == [MERGED_FILE]


@pytest.mark.timeout(60)
def test_the_zip_holds_the_chunk_files_and_their_index(tmp_path):
    import zipfile

    from generation_core.driver.publish import write_zip

    folder = StorageFolder(str(tmp_path / "run"))
    _write_run(folder, _random_records(7))
    folder.put_json("run.json", {})
    folder.put_json("manifest.json", {})
    merge_run_chunked(folder, chunk_size=3, **_lengths())
    write_zip(folder)
    names = zipfile.ZipFile(tmp_path / "run" / "trajectories.zip").namelist()
    assert names == [
        CHUNK_INDEX_FILE,
        "trajectories-00000.pkl",
        "trajectories-00001.pkl",
        "trajectories-00002.pkl",
        "run.json",
        "manifest.json",
    ]
    merge_run(folder, **_lengths())
    write_zip(folder)
    assert zipfile.ZipFile(tmp_path / "run" / "trajectories.zip").namelist() == [
        MERGED_FILE,
        "run.json",
        "manifest.json",
    ]


@pytest.mark.timeout(30)
def test_a_trajectory_longer_than_the_run_allows_is_named():
    from generation_core.errors import GenrunError

    records = _random_records(3)
    records[2].response_ids.extend([5] * RESPONSE_LENGTH)
    with pytest.raises(
        GenrunError,
        match=r"sample 1001:0 has \d+ prompt / \d+ response tokens, beyond prompt_length=12 / response_length=10",
    ):
        build_dataproto(records, **_lengths())


@pytest.mark.timeout(60)
def test_finish_run_merges_in_chunks_when_configured(tmp_path):
    from generation_core.config.loading import load_config
    from generation_core.outputs.finish import finish_run
    from generation_core.preflight.preflight import RunPlan

    folder = StorageFolder(str(tmp_path / "run"))
    records = _random_records(9)
    _write_run(folder, records)
    for chunk_size, entry in (("4", CHUNK_INDEX_FILE), ("null", MERGED_FILE)):
        cfg = load_config(
            [
                f"generation.merge_chunk_size={chunk_size}",
                f"data.max_prompt_length={PROMPT_LENGTH}",
                f"data.max_response_length={RESPONSE_LENGTH}",
                f"trainer.default_local_dir={tmp_path / 'run'}",
            ]
        )
        # Only the merge is under test: no shards, no dataset.
        summary = finish_run(RunPlan(cfg, "fingerprint", [], PAD), [], 1.0)
        assert summary["artifact"] == folder.display(entry) and summary["merged_rows"] == 9
        assert set(summary["request_latency_s"]) == {"p50", "p95"}
        assert merged_files(folder)[0] == entry


@pytest.mark.timeout(60)
def test_without_a_chunk_size_a_run_past_the_file_size_limit_is_merged_in_chunks(tmp_path):
    from generation_core.outputs.merge import merge_output, scan_run
    from generation_core.outputs.padding import Padding, padded_row_bytes

    folder = StorageFolder(str(tmp_path / "run"))
    _write_run(folder, _random_records(9))
    padding = Padding(PROMPT_LENGTH, RESPONSE_LENGTH, PAD)
    whole = merge_run(folder, **_lengths())
    row_bytes = padded_row_bytes(scan_run(folder).layout, padding)
    # The estimate covers what the DataProto's tensors really take.
    assert row_bytes * len(whole) >= sum(t.element_size() * t.numel() for t in whole.batch.values())

    # Room for 4 rows a file: 9 rows become chunks of 4, 4, 1, identical to the one-file merge.
    merged = merge_output(folder, padding, max_file_bytes=4 * row_bytes + row_bytes // 2)
    assert merged.entry_file == CHUNK_INDEX_FILE and merged.rows == 9
    assert [c["rows"] for c in folder.read_json(CHUNK_INDEX_FILE)["chunks"]] == [4, 4, 1]
    _assert_same_dataproto(load_chunks(folder), whole, metrics_as_lists=True)
    # Room for all of them: one trajectories.pkl, as before.
    assert merge_output(folder, padding, max_file_bytes=9 * row_bytes).entry_file == MERGED_FILE
    assert merged_files(folder) == [MERGED_FILE]


@pytest.mark.timeout(60)
def test_a_chunked_remerge_that_crashes_leaves_no_index_over_rewritten_chunks(tmp_path, monkeypatch):
    import generation_core.outputs.merge as merge

    folder = StorageFolder(str(tmp_path / "run"))
    _write_run(folder, _random_records(9))
    merge_run_chunked(folder, chunk_size=3, **_lengths())
    real_dump, written = merge.dump_dataproto, []

    def dump_then_crash(data, handle):
        if written:
            raise OSError("disk full")
        written.append(len(data))
        return real_dump(data, handle)

    monkeypatch.setattr(merge, "dump_dataproto", dump_then_crash)
    with pytest.raises(OSError):
        merge_run_chunked(folder, chunk_size=2, **_lengths())
    assert written == [2] and merged_files(folder) == [], "chunk 0 was rewritten: no index may list it"


# --- the same comparison on trajectories the bundled model generated ------------------------


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_merged_run_equals_verl_postprocess_of_the_generated_outputs(ray_local, model_dir, tmp_path, monkeypatch):
    """A real run (hf engine, the bundled model, sampled, n=2, logprobs): verl's own
    per-sample and batch postprocessing of the agent-loop outputs the run produced equals the
    trajectories.pkl that the run's merge wrote from its parts."""
    from generation_core.driver.in_process import run_in_process
    from generation_core.preflight.preflight import preflight
    from tests.conftest import chat_rows, write_parquet

    captured: dict[tuple[int, int], tuple[AgentLoopOutput, dict]] = {}
    to_record = StreamingWorker.record_from_output

    def capture(key, output, kwargs):
        captured[key] = (output.model_copy(deep=True), dict(kwargs))
        return to_record(key, output, kwargs)

    # The shard jobs of run_in_process run in this process: every output verl's agent loop returned.
    monkeypatch.setattr(StreamingWorker, "record_from_output", staticmethod(capture))
    prompts = write_parquet(tmp_path / "prompts.parquet", chat_rows(4))
    out = tmp_path / "run"
    plan = preflight(
        [
            f"data.train_files={prompts}",
            f"trainer.default_local_dir={out}",
            "actor_rollout_ref.rollout.name=hf",
            "actor_rollout_ref.rollout.temperature=1.0",
            "actor_rollout_ref.rollout.calculate_log_probs=true",
            "actor_rollout_ref.rollout.n=2",
            "data.max_prompt_length=48",
            "data.max_response_length=10",
            "generation.save_batch_size=3",
            "generation.show_progress=false",
        ]
    )
    assert run_in_process(plan)["num_trajectories"] == 8
    merged = DataProto.load_from_disk(str(out / "trajectories.pkl"))

    keys = sorted(captured)
    assert keys == [(i, n) for i in range(4) for n in range(2)]
    verl_worker = StreamingWorker(plan.cfg, llm_client=None).worker

    async def verl_side():
        return [await verl_worker._agent_loop_postprocess(captured[key][0], False, **captured[key][1]) for key in keys]

    padded = asyncio.run(verl_side())
    rows = [captured[key][1] for key in keys]
    non_tensor_input = {
        name: np.fromiter([row[name] for row in rows], dtype=object, count=len(rows)) for name in rows[0]
    }
    expected = verl_worker._postprocess(padded, input_non_tensor_batch=non_tensor_input)

    # Real outputs, not shaped by hand: prompts of several lengths, logprobs from the model.
    prompt_lengths = {len(captured[key][0].prompt_ids) for key in keys}
    assert len(prompt_lengths) > 1, prompt_lengths
    assert "rollout_log_probs" in merged.batch.keys()
    _assert_equals_verl(merged, expected)
