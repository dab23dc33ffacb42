"""Keeping every replica busy (issue 34): the simulated engine (a batch limit that queues, prefix
hits that cost nothing, seeded lengths), the routing decisions (the load every shard worker
shares, prefix-affinity groups, `local` as before), and one small run on the simulated engine
through the whole pipeline (exact counts, no duplicates, the prefix cache's report)."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest
from omegaconf import OmegaConf

from bench.sim.engine import SimulatedEngine, SimulatedSettings, VirtualClockLoop
from generation_core.engines.base import prefix_hit_rate
from generation_core.serving.replica_loads import ReplicaChooser, ReplicaLoads
from generation_core.serving.routing import RoutingClient

pytestmark = pytest.mark.timeout(120)

SAMPLING = {"temperature": 1.0}


def _engine(**kwargs: Any) -> SimulatedEngine:
    settings = dict(
        prompt_length=64,
        response_length=64,
        eos_token_id=2,
        max_num_seqs=2,
        decode_seconds_per_step=0.02,
        prefill_seconds_per_token=0.001,
        time_scale=1.0,
    )
    return SimulatedEngine(SimulatedSettings(**{**settings, **kwargs}))


def _in_simulated_time(coroutine):
    loop = VirtualClockLoop()
    try:
        return loop.run_until_complete(coroutine)
    finally:
        idle = asyncio.all_tasks(loop)  # the engines' step loops, waiting for work
        for task in idle:
            task.cancel()
        loop.run_until_complete(asyncio.gather(*idle, return_exceptions=True))
        loop.close()


# ---- the simulated engine ---------------------------------------------------------------------


def test_requests_past_max_num_seqs_queue_and_every_one_is_answered_once():
    engine = _engine(response_tokens_median=4)

    async def scenario():
        answers = asyncio.gather(
            *[engine.generate(f"r{i}", prompt_ids=[10 + i] * 5, sampling_params=SAMPLING) for i in range(5)]
        )
        await asyncio.sleep(0.001)
        seen = (engine.stats["running"], engine.stats["waiting"])
        return seen, await answers, asyncio.get_running_loop().time()

    (running, waiting), answers, elapsed = _in_simulated_time(scenario())
    assert (running, waiting) == (2, 3), "two slots, three requests queue"
    assert [len(a.token_ids) for a in answers] == [4] * 5 and all(
        a.token_ids[-1] == 2 and a.stop_reason == "stop" for a in answers
    )
    # Three rounds of 4 steps (2 + 2 + 1 sequences), each first step with its joiners' prefill.
    assert engine.stats["steps"] == 12 and engine.stats["requests"] == 5 and engine.stats["generated_tokens"] == 20
    assert elapsed == pytest.approx(12 * 0.02 + 25 * 0.001)
    assert engine.stats["busy_slot_seconds"] == pytest.approx(
        (2 * 4 + 2 * 4 + 4) * 0.02 + (2 * 10 + 2 * 10 + 5) * 0.001
    )


def test_a_prefix_in_the_cache_costs_nothing_and_is_counted():
    engine = _engine(response_tokens_median=1, cache_block_tokens=4, max_num_seqs=8)
    prompt = list(range(3, 13))  # 10 tokens: two whole blocks of 4

    async def scenario():
        await engine.generate("a", prompt_ids=prompt, sampling_params=SAMPLING)
        first = engine.stats["simulated_seconds"]
        await engine.generate("b", prompt_ids=prompt, sampling_params=SAMPLING)
        return first, engine.stats["simulated_seconds"] - first

    first, second = _in_simulated_time(scenario())
    assert first == pytest.approx(0.02 + 10 * 0.001)
    assert second == pytest.approx(0.02 + 2 * 0.001), "8 of 10 prompt tokens reused: only the last 2 prefilled"
    s = engine.stats
    assert (s["prefix_hits"], s["prefix_misses"], s["prefix_reused_tokens"], s["prefill_tokens"]) == (1, 1, 8, 12)
    assert prefix_hit_rate(s) == pytest.approx(8 / 20)


def test_steps_follow_each_other_and_a_late_one_is_counted_not_hidden():
    """Issue 46 item 2: at a GPU's rate the stand-in keeps its steps on its own clock (its Python
    does not stretch them), and a step its busy process started late shows in `late_seconds`."""

    def answered_at(busy_seconds: float) -> tuple[float, float]:
        engine = _engine(response_tokens_median=4, prefill_seconds_per_token=0.0)

        async def scenario():
            loop = asyncio.get_running_loop()

            async def busy():  # the process does other work for a while, inside the first step
                await asyncio.sleep(0.01)
                loop.now += busy_seconds  # VirtualClockLoop's clock

            await asyncio.gather(engine.generate("r", prompt_ids=[5, 6], sampling_params=SAMPLING), busy())
            return loop.time()

        return _in_simulated_time(scenario()), engine.stats["late_seconds"]

    assert answered_at(0.0) == (pytest.approx(4 * 0.02), 0.0)
    # Busy from 0.01 to 0.06: the first step's end (0.02) is seen at 0.06, the next three follow it.
    done, late = answered_at(0.05)
    assert done == pytest.approx(0.06 + 3 * 0.02) and late == pytest.approx(0.04)


def test_the_prefix_cache_is_bounded():
    engine = _engine(response_tokens_median=1, cache_block_tokens=4, prefix_cache_tokens=8)

    async def scenario():
        for prompt in ([3] * 8, [4] * 8, [3] * 8):
            await engine.generate("x", prompt_ids=prompt, sampling_params=SAMPLING)

    _in_simulated_time(scenario())
    assert engine.stats["prefix_hits"] == 0, "two blocks fit: the second prompt evicted the first"


def test_lengths_are_seeded_long_tailed_and_capped_by_the_budget():
    def lengths(engine_seed: int) -> list[int]:
        engine = _engine(
            response_tokens_median=8, response_tokens_sigma=1.0, seed=engine_seed, max_num_seqs=64, response_length=40
        )

        async def scenario():
            outs = await asyncio.gather(
                *[
                    engine.generate("r", prompt_ids=[5, 6], sampling_params={"temperature": 1.0, "seed": k})
                    for k in range(64)
                ]
            )
            return [len(o.token_ids) for o in outs], [o.stop_reason for o in outs]

        got, reasons = _in_simulated_time(scenario())
        assert all(r == "length" for n, r in zip(got, reasons, strict=True) if n == 40)
        return got

    first = lengths(0)
    assert lengths(0) == first, "same engine seed, prompt and request seeds: same lengths"
    assert lengths(1) != first
    assert min(first) < 8 < max(first) and max(first) >= 24, "spread around the median, with a tail"
    assert max(first) <= 40


# ---- routing decisions ------------------------------------------------------------------------


def test_the_estimate_is_the_replicas_report_plus_what_this_client_did_since():
    loads = ReplicaLoads(["a", "b"])
    for _ in range(3):
        loads.sent("a")
    loads.report("a", 10, answered=1)  # sent with one answer this client has not counted off yet
    loads.answered("a")
    assert loads.estimate("a") == 10
    loads.sent("a")
    assert loads.estimate("a") == 11
    assert loads.estimate("b") == 0, "never reported: this client's own count"
    loads.report("a", 0)
    assert loads.estimate("a") == 3, "never below this client's own outstanding requests"


def test_least_loaded_goes_by_the_shared_load_and_local_by_its_own_count():
    loads = ReplicaLoads(["a", "b", "c"])
    loads.report("a", 7)
    loads.report("b", 2)
    loads.report("c", 5)
    shared = ReplicaChooser("least_loaded", random.Random(0))
    assert [shared.choose(["a", "b", "c"], loads, [i]) for i in range(3)] == ["b", "b", "b"], "choosing does not send"
    assert shared.choose(["a", "c"], loads, [1]) == "c", "only replicas in rotation"
    loads.sent("a")
    loads.sent("a")
    local = ReplicaChooser("local", random.Random(0))
    assert {local.choose(["a", "b", "c"], loads, [i]) for i in range(20)} == {"b", "c"}, "its own count: 2, 0, 0"


def test_the_samples_of_a_prompt_go_to_one_replica_and_the_next_prompt_to_the_least_loaded():
    loads = ReplicaLoads(["a", "b"])
    chooser = ReplicaChooser("prefix_affinity", random.Random(0))
    first = chooser.choose(["a", "b"], loads, [1, 2, 3])
    picks = []
    for _ in range(8):
        picks.append(chooser.choose(["a", "b"], loads, [1, 2, 3]))
        loads.sent(picks[-1])
    assert picks == [first] * 8
    other = "b" if first == "a" else "a"
    assert chooser.choose(["a", "b"], loads, [4, 5]) == other
    assert chooser.choose([other], loads, [1, 2, 3]) == other, "its replica out of rotation: elsewhere"
    assert ReplicaChooser("least_loaded", random.Random(0)).choose(["a", "b"], loads, [1, 2, 3]) == other


class CountingBackend:
    """A replica whose load is every client's requests in it, reported as EngineServer does."""

    server_failures = (ConnectionError,)
    probe_interval = 0.01

    def __init__(self, name: str):
        self.name = name
        self.outstanding = 0
        self.served: list[str] = []
        self.release = asyncio.Event()
        self._reports: list[Any] = []

    def watch_load(self, report) -> None:
        self._reports.append(report)

    async def read_load(self) -> int:
        return self.outstanding

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs):
        self.outstanding += 1
        self.served.append(request_id)
        await self.release.wait()
        self.outstanding -= 1
        from verl.workers.rollout.replica import TokenOutput

        return TokenOutput(token_ids=[1], stop_reason="stop")

    async def probe(self) -> bool:
        return True


class SharedSource:
    def __init__(self, backends):
        self.backends = backends

    async def connect(self, wait_seconds: float = 0.0):
        return dict(self.backends), {}

    async def aclose(self) -> None:
        return None


@pytest.mark.parametrize("routing, second_client_on_y", [("least_loaded", 4), ("prefix_affinity", 4), ("local", None)])
def test_a_second_shard_worker_routes_around_the_first_ones_load(routing, second_client_on_y):
    """Worker 1's four samples of one prompt sit on one replica; worker 2's four new prompts go
    to the other with the shared load, and two and two with `local` (it sees only its own)."""
    backends = {"x": CountingBackend("x"), "y": CountingBackend("y")}
    config = OmegaConf.create(
        {"actor_rollout_ref": {"rollout": {"name": "simulated"}}, "generation": {"routing": routing}}
    )

    async def scenario():
        first = RoutingClient(
            config, SharedSource(backends), chooser=ReplicaChooser("prefix_affinity", random.Random(1))
        )
        one = [
            asyncio.ensure_future(first.generate(f"w1-{k}", prompt_ids=[7, 7, 7], sampling_params=SAMPLING))
            for k in range(4)
        ]
        # Until the requests arrive (a wait, not a fixed sleep: a busy machine may take longer).
        while not any(b.outstanding == 4 for b in backends.values()):
            await asyncio.sleep(0.001)
        loaded = next(sid for sid, b in backends.items() if b.outstanding == 4)
        second = RoutingClient(config, SharedSource(backends), chooser=ReplicaChooser(routing, random.Random(2)))
        two = [
            asyncio.ensure_future(second.generate(f"w2-{k}", prompt_ids=[k, 9], sampling_params=SAMPLING))
            for k in range(4)
        ]
        while sum(b.outstanding for b in backends.values()) < 8:
            await asyncio.sleep(0.001)
        placed = {sid: sum(r.startswith("w2") for r in b.served) for sid, b in backends.items()}
        for b in backends.values():
            b.release.set()
        await asyncio.gather(*one, *two)
        await first.aclose()
        await second.aclose()
        return loaded, placed

    loaded, placed = asyncio.run(scenario())
    other = "y" if loaded == "x" else "x"
    if second_client_on_y is None:
        assert placed == {"x": 2, "y": 2}
    else:
        assert placed[other] == second_client_on_y and placed[loaded] == 0


def test_the_turns_of_a_trajectory_follow_its_first_turn():
    backends = {"x": CountingBackend("x"), "y": CountingBackend("y")}
    for b in backends.values():
        b.release.set()
    config = OmegaConf.create(
        {"actor_rollout_ref": {"rollout": {"name": "simulated"}}, "generation": {"routing": "prefix_affinity"}}
    )

    async def scenario():
        client = RoutingClient(config, SharedSource(backends))
        prompt = [3, 4]
        for turn in range(4):
            await client.generate("trajectory", prompt_ids=prompt, sampling_params=SAMPLING)
            prompt = prompt + [turn + 10] * 3
        await client.aclose()

    asyncio.run(scenario())
    assert sorted(len(b.served) for b in backends.values()) == [0, 4]


# ---- one run through the pipeline -------------------------------------------------------------


def test_a_run_on_the_simulated_engine_has_every_trajectory_once_and_reports_its_prefix_cache(tmp_path):
    import pickle

    from bench.sim import register
    from generation_core.driver.in_process import run_in_process
    from generation_core.preflight.preflight import preflight

    register()
    engine = "+actor_rollout_ref.rollout.engine_kwargs.simulated"
    plan = preflight(
        [
            f"trainer.default_local_dir={tmp_path / 'out'}",
            "actor_rollout_ref.rollout.name=simulated",
            "actor_rollout_ref.rollout.n=4",
            "trainer.n_gpus_per_node=2",
            "generation.num_shards=2",
            "generation.show_progress=false",
            "actor_rollout_ref.rollout.max_num_seqs=8",
            f"{engine}.time_scale=0.01",
            f"{engine}.response_tokens_sigma=1.0",
            f"{engine}.response_tokens_median=16",
            f"{engine}.cache_block_tokens=4",
            "data.train_max_samples=16",
        ]
    )
    summary = run_in_process(plan)
    rows = sum(len(shard) for shard in plan.shards) - summary.get("filtered_overlong_prompts", 0)
    assert rows == 16
    assert summary["num_trajectories"] == 4 * rows
    with open(tmp_path / "out" / "trajectories.pkl", "rb") as f:
        data = pickle.load(f)
    assert data.non_tensor_batch["index"].tolist() == [i for i in range(rows) for _ in range(4)], (
        "every sample of every row once"
    )
    report = summary["prefix_cache"]
    assert len(report["replicas"]) == 2
    # Each prompt prefilled once, its other three samples reuse its whole blocks (most of it).
    assert report["run"] > 0.6


# ---- outside the product: bench/sim behind the registration hook ------------------------------


def test_the_simulator_is_no_engine_of_genrun_until_bench_sim_registers_it(tmp_path):
    """Issue 44 item 5: the simulated engine lives in bench/sim. A run that names it, or sets its
    former genrun.yaml keys, without `bench.sim.register()` is refused as for any unknown engine or
    key (before anything is written)."""
    from tests.conftest import run_genrun

    out = tmp_path / "out"
    engine = run_genrun(["actor_rollout_ref.rollout.name=simulated", f"trainer.default_local_dir={out}"], timeout=120)
    assert engine.returncode == 2, engine.stderr[-2000:]
    assert "unknown actor_rollout_ref.rollout.name='simulated'; known engines: " in engine.stderr
    key = run_genrun(["actor_rollout_ref.rollout.engine_kwargs.simulated.time_scale=0.01"], timeout=120)
    assert key.returncode == 2, key.stderr[-2000:]
    assert "unknown config key 'actor_rollout_ref.rollout.engine_kwargs.simulated.time_scale'" in key.stderr
    assert not out.exists()


def test_registering_serves_the_simulator_as_a_cpu_engine_and_it_checks_its_own_keys():
    """Issue 44 item 5: the hook (engines/replicas.register_engine) is all the product knows of
    the simulator; its keys are checked by bench/sim/replica.py, one line naming the key."""
    from bench.sim import register
    from bench.sim.replica import SimulatedReplica, simulated_kwargs
    from generation_core.config.layout import CPU_CAPABLE_ENGINES
    from generation_core.engines.replicas import GENRUN_ENGINES, InstantReplica, register_engine
    from generation_core.errors import GenrunError
    from generation_core.verl_adapter import registered_engine_names

    register()
    register()  # twice in one process (a test and a bench script): the same engine, no error
    assert GENRUN_ENGINES["simulated"] is SimulatedReplica and "simulated" in CPU_CAPABLE_ENGINES
    assert "simulated" in registered_engine_names()
    with pytest.raises(GenrunError, match=r"rollout.name='instant' is already an engine"):
        register_engine("instant", SimulatedReplica)
    with pytest.raises(GenrunError, match=r"rollout.name='sglang' is already an engine"):
        register_engine("sglang", InstantReplica)

    assert simulated_kwargs({"simulated": {"time_scale": 0.01, "seed": 3}}) == {"time_scale": 0.01, "seed": 3}
    assert simulated_kwargs({"hf": {"device": "cpu"}}) == {}
    key = "actor_rollout_ref.rollout.engine_kwargs.simulated"
    for given, message in (
        ({"time_scal": 0.01}, f"unknown key {key}.time_scal; the simulator's keys: decode_seconds_per_step, "),
        ({"seed": 1.5}, f"invalid {key}.seed=1.5: must be an integer >= 0"),
        ({"time_scale": "fast"}, f"invalid {key}.time_scale='fast': must be a number >= 0"),
        ({"response_tokens_prompt_share": 1.5}, f"invalid {key}.response_tokens_prompt_share=1.5: must be a fraction"),
    ):
        with pytest.raises(GenrunError) as refused:
            simulated_kwargs({"simulated": given})
        assert str(refused.value).startswith(message) and "\n" not in str(refused.value)
