"""The transformers engine against the model itself (greedy = model.generate, logprobs = re-score),
no request left waiting when a step fails or the engine stops, stop reasons, the instant engine's answers."""

import asyncio
import re
import time
import uuid

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from generation_core.engines.base import Engine, SamplingParams
from generation_core.engines.hf.engine import EngineSettings, HFEngine
from generation_core.engines.hf.sampling import sample_next_tokens
from generation_core.engines.instant import InstantEngine, InstantSettings
from generation_core.engines.remote import CompletionsServer

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def engine(model_dir):
    engine = HFEngine(
        EngineSettings(str(model_dir), prompt_length=128, response_length=24, max_batch_size=8, num_threads=2)
    )
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def reference(model_dir):
    return AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()


TEXTS = [
    "What is 2 + 2?",
    "Name a color.",
    "Say hello to the world in a long friendly way.",
    "What is the capital of Italy?",
]


def _chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The chat template's token ids (a list, or in a BatchEncoding depending on the version)."""
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return encoded if isinstance(encoded, list) else list(encoded["input_ids"])


@pytest.fixture(scope="module")
def prompts(model_dir):
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    return [_chat_ids(tokenizer, [{"role": "user", "content": t}]) for t in TEXTS]


def _generate_all(engine, prompts, params, stagger=0.0):
    async def one(i, p):
        await asyncio.sleep(stagger * i)
        return await engine.generate(f"r{i}", prompt_ids=p, sampling_params=params)

    async def main():
        return await asyncio.gather(*[one(i, p) for i, p in enumerate(prompts)])

    return asyncio.run(main())


def test_engines_implement_the_contract(engine):
    server = CompletionsServer("http://127.0.0.1:1", httpx.AsyncClient(), model="m", prompt_length=8, response_length=8)
    instant = InstantEngine(InstantSettings(prompt_length=8, response_length=8, eos_token_id=2))
    assert all(isinstance(e, Engine) for e in (engine, instant, server))


def test_greedy_matches_model_generate_and_logprobs_match_a_rescore(engine, reference, prompts):
    outputs = _generate_all(engine, prompts, {"temperature": 0, "logprobs": True})
    for prompt, out in zip(prompts, outputs, strict=True):
        expected = reference.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=24,
            do_sample=False,
            pad_token_id=2,
        )[0, len(prompt) :].tolist()
        assert out.token_ids == expected
        with torch.no_grad():
            logits = reference(torch.tensor([prompt + out.token_ids])).logits[0].log_softmax(-1)
        rescored = [logits[len(prompt) - 1 + j, t].item() for j, t in enumerate(out.token_ids)]
        assert len(out.log_probs) == len(out.token_ids)
        assert max(abs(a - b) for a, b in zip(rescored, out.log_probs, strict=True)) < 1e-3


def test_requests_joining_a_running_batch_get_the_same_tokens(engine, prompts):
    together = _generate_all(engine, prompts, {"temperature": 0})
    staggered = _generate_all(engine, prompts, {"temperature": 0}, stagger=0.15)
    assert [o.token_ids for o in staggered] == [o.token_ids for o in together]


def test_concurrent_requests_share_forward_passes(engine, prompts):
    before = engine.stats["forward_steps"]
    outputs = _generate_all(engine, prompts * 2, {"temperature": 0})
    steps = engine.stats["forward_steps"] - before
    assert steps < sum(len(o.token_ids) for o in outputs) / 2


def test_length_limits_follow_verl(engine, prompts):
    # verl sends no max_tokens: min(response_length, prompt_length + response_length - len(prompt)).
    long_prompt = (prompts[2] * 4)[:140]
    out = _generate_all(engine, [long_prompt], {"temperature": 0, "top_k": -1})[0]
    assert len(out.token_ids) == 12 or (len(out.token_ids) < 12 and out.token_ids[-1] == 2)
    capped = _generate_all(engine, [prompts[2]], {"temperature": 0, "max_tokens": 3})[0]
    assert len(capped.token_ids) == 3


def test_stops_at_eos(engine, prompts):
    out = _generate_all(engine, [prompts[1]], {"temperature": 0})[0]
    if 2 in out.token_ids:
        assert out.token_ids.index(2) == len(out.token_ids) - 1


def test_sampling_honours_seed_top_k_and_temperature(engine, prompts):
    seeded = {"temperature": 1.0, "top_p": 0.9, "seed": 7}
    a = _generate_all(engine, [prompts[0]], seeded)[0]
    b = _generate_all(engine, [prompts[0]], seeded)[0]
    assert a.token_ids == b.token_ids
    greedy = _generate_all(engine, [prompts[0]], {"temperature": 0})[0]
    top1 = _generate_all(engine, [prompts[0]], {"temperature": 1.0, "top_k": 1})[0]
    assert top1.token_ids == greedy.token_ids


def test_bad_sampling_params_fail_the_request_not_the_engine(engine, prompts):
    with pytest.raises(ValueError, match="temperature"):
        _generate_all(engine, [prompts[0]], {"temperature": -1})
    assert _generate_all(engine, [prompts[0]], {"temperature": 0})[0].token_ids


def test_a_failing_forward_fails_its_requests_and_the_engine_recovers(engine, prompts):
    original = engine.model.forward
    calls = {"n": 0}

    def broken_once(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected forward failure")
        return original(*args, **kwargs)

    engine.model.forward = broken_once
    try:
        with pytest.raises(RuntimeError, match="injected forward failure"):
            _generate_all(engine, [prompts[0]], {"temperature": 0})
    finally:
        engine.model.forward = original
    assert _generate_all(engine, [prompts[0]], {"temperature": 0})[0].token_ids


@pytest.mark.parametrize("mixed_steps", [True, False], ids=["mixed-steps", "plain-steps"])
def test_slots_reused_store_shifted_and_grown_every_token_is_still_the_greedy_choice(
    model_dir, reference, prompts, mixed_steps
):
    """Three slots, nine requests of very different lengths arriving over time: slots are
    reused, sequences move down into slots others left, the KV store grows past its first size
    and shifts its window left, and a longer
    prompt joins a batch whose timeline is shorter than it. Every token must still be the
    model's greedy choice given everything before it, and its logprob the re-scored one; with
    joiners prefilled in the decode step (mixed) and apart (plain, the path for models the
    packed attention cannot drive)."""
    small = HFEngine(
        EngineSettings(
            str(model_dir),
            prompt_length=128,
            response_length=100,
            max_batch_size=3,
            num_threads=2,
            mixed_steps=mixed_steps,
        )
    )
    assert small._mixed is mixed_steps
    lengths = [100, 4, 40, 9, 70, 1, 25, 50, 12]
    requests = [(prompts[i % len(prompts)], n) for i, n in enumerate(lengths)]

    async def one(i, prompt, n):
        await asyncio.sleep(0.2 * i)
        params = {"temperature": 0, "logprobs": True, "max_tokens": n, "ignore_eos": True}
        return await small.generate(f"s{i}", prompt_ids=prompt, sampling_params=params)

    async def main():
        return await asyncio.gather(*[one(i, p, n) for i, (p, n) in enumerate(requests)])

    try:
        outputs = asyncio.run(main())
    finally:
        small.shutdown()
    # Sequences were moved down into slots that shorter ones left (SlotBatch.compact).
    assert small.stats["slot_moves"] > 0
    for (prompt, n), out in zip(requests, outputs, strict=True):
        assert len(out.token_ids) == n
        with torch.no_grad():
            logits = reference(torch.tensor([prompt + out.token_ids])).logits[0].log_softmax(-1)
        rows = logits[len(prompt) - 1 : len(prompt) - 1 + n]
        chosen = rows.gather(1, torch.tensor(out.token_ids).unsqueeze(1)).squeeze(1)
        # Greedy: each chosen token's logprob is the row's best (fp32 batch kernels: 1e-3 slack).
        assert (rows.max(dim=1).values - chosen).max().item() < 1e-3
        assert (chosen - torch.tensor(out.log_probs)).abs().max().item() < 1e-3


def test_mixed_steps_prefill_joiners_inside_decode_steps_with_the_same_answers(model_dir, prompts):
    """Requests joining a running batch one by one: with mixed steps joiners are prefilled in the
    batch's decode pass, a pass runs at most max_step_tokens tokens (one joiner may pass it
    alone), and every answer and logprob equals the plain engine's."""
    staggered = prompts * 2
    params = {"temperature": 0, "logprobs": True, "max_tokens": 16, "ignore_eos": True}
    results = {}
    for mixed in (True, False):
        # No prefix reuse: every prompt token is prefilled, so the counts compare.
        engine = HFEngine(
            EngineSettings(
                str(model_dir),
                prompt_length=128,
                response_length=24,
                max_batch_size=8,
                num_threads=2,
                mixed_steps=mixed,
                max_step_tokens=60,
                prefix_cache_bytes=0,
            )
        )
        try:
            outputs = _generate_all(engine, staggered, params, stagger=0.1)
            results[mixed] = (outputs, dict(engine.stats))
        finally:
            engine.shutdown()
    (mixed_out, mixed_stats), (plain_out, plain_stats) = results[True], results[False]
    assert [o.token_ids for o in mixed_out] == [o.token_ids for o in plain_out]
    assert (
        max(
            abs(a - b)
            for m, p in zip(mixed_out, plain_out, strict=True)
            for a, b in zip(m.log_probs, p.log_probs, strict=True)
        )
        < 1e-4
    )
    assert mixed_stats["prefill_tokens"] == plain_stats["prefill_tokens"] == sum(len(p) for p in staggered)
    assert mixed_stats["mixed_steps"] > 0 and plain_stats["mixed_steps"] == 0
    assert mixed_stats["largest_step_tokens"] <= max(60, 8 + max(len(p) for p in staggered))


def test_a_model_whose_attention_mixed_steps_cannot_drive_runs_plain_steps(model_dir, prompts, monkeypatch):
    from generation_core.engines.hf import packed_step

    monkeypatch.setattr(packed_step, "agrees_with_plain_forwards", lambda *args: False)
    engine = HFEngine(
        EngineSettings(str(model_dir), prompt_length=128, response_length=24, max_batch_size=4, num_threads=2)
    )
    try:
        assert engine._mixed is False
        assert engine.model.config._attn_implementation == "sdpa"
        assert len(_generate_all(engine, prompts[:2], {"temperature": 0, "max_tokens": 4})[1].token_ids) == 4
    finally:
        engine.shutdown()


def _per_row_reference(logits, params, generators):
    """The sampler as it was before it ran batched: one row at a time on the CPU."""
    return torch.cat(
        [
            sample_next_tokens(logits[i : i + 1], [p], [g])
            for i, (p, g) in enumerate(zip(params, generators, strict=True))
        ]
    )


def test_batched_sampler_keeps_per_row_greedy_top_k_top_p_and_seeds():
    torch.manual_seed(0)
    vocab = 300
    logits = torch.randn(6, vocab) * 3
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, top_k=5),
        SamplingParams(temperature=0.7, top_p=0.3),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=1.0, top_k=20, seed=3),
        SamplingParams(temperature=1.0, top_k=1),
    ]
    top5 = set(logits[1].topk(5).indices.tolist())
    probs = (logits[2] / 0.7).softmax(-1)
    sorted_p, order = probs.sort(descending=True)
    nucleus = set(order[: int(((sorted_p.cumsum(0) - sorted_p) < 0.3).sum())].tolist())
    seeded = set()
    for _ in range(40):
        chosen = sample_next_tokens(logits, params, [None, None, None, None, torch.Generator().manual_seed(3), None])
        assert chosen.dtype == torch.long and chosen.shape == (6,)
        assert int(chosen[0]) == int(logits[0].argmax()) and int(chosen[5]) == int(logits[5].argmax())
        assert int(chosen[1]) in top5
        assert int(chosen[2]) in nucleus
        seeded.add(int(chosen[4]))
    # A seeded row draws with its own generator: the same token whatever its neighbours, and the
    # same token as the one-row-at-a-time sampler gives.
    alone = _per_row_reference(logits[4:5], params[4:5], [torch.Generator().manual_seed(3)])
    assert seeded == {int(alone[0])}
    # All-greedy batch: argmax of every row.
    assert (
        sample_next_tokens(logits, [SamplingParams(temperature=0.0)] * 6, [None] * 6).tolist()
        == logits.argmax(-1).tolist()
    )


def test_unfiltered_sampling_draws_from_the_tempered_softmax_and_seeded_rows_stay_their_own():
    """No top-k/top-p (the default): tokens are drawn without sorting the vocabulary; the
    frequencies follow softmax(logits / T) and a seeded row ignores its neighbours."""
    torch.manual_seed(1)
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(4000, 1)
    params = [SamplingParams(temperature=0.5)] * 4000
    chosen = sample_next_tokens(logits, params, [None] * 4000)
    observed = torch.bincount(chosen, minlength=4).float() / 4000
    expected = (logits[0] / 0.5).softmax(-1)
    assert (observed - expected).abs().max().item() < 0.03, (observed, expected)
    mixed = [SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, seed=5), SamplingParams(temperature=0.0)]
    wide = torch.randn(3, 500)
    draws = {int(sample_next_tokens(wide, mixed, [None, torch.Generator().manual_seed(5), None])[1]) for _ in range(20)}
    alone = int(sample_next_tokens(wide[1:2], mixed[1:2], [torch.Generator().manual_seed(5)])[0])
    assert draws == {alone}


def test_filtered_sampling_follows_the_renormalised_odds_and_never_draws_a_removed_token():
    """top-k 3 over weights whose removed tokens sit at both ends of the vocabulary: the draws
    follow the kept tokens' renormalised softmax, and a removed token (weight 0) never comes,
    not even at the extremes of the uniform numbers the draw looks up."""
    torch.manual_seed(2)
    logits = torch.tensor([[-5.0, 1.0, 2.0, 0.5, -4.0, -6.0]]).repeat(20000, 1)
    params = [SamplingParams(temperature=1.0, top_k=3)] * 20000
    chosen = sample_next_tokens(logits, params, [None] * 20000)
    observed = torch.bincount(chosen, minlength=6).float() / 20000
    expected = torch.zeros(6)
    expected[[1, 2, 3]] = logits[0, [1, 2, 3]].softmax(-1)
    assert observed[[0, 4, 5]].sum().item() == 0, observed
    assert (observed - expected).abs().max().item() < 0.02, (observed, expected)


@pytest.mark.parametrize("uniform, expected", [(0.0, 1), (1.0, 2)], ids=["lowest", "highest"])
def test_the_draw_at_the_ends_of_its_uniform_range_picks_a_kept_token(monkeypatch, uniform, expected):
    """The draw looks a uniform number up in the row's cumulative weights: at 0 it lands on the
    first token with weight, and where the product rounds up to the row's total (forced here
    with 1.0) on the likeliest token, never on a removed (zero-weight) one at either end."""
    from generation_core.engines.hf import sampling

    probs = torch.tensor([[0.0, 0.3, 0.7, 0.0]])
    monkeypatch.setattr(sampling.torch, "rand", lambda n, **kw: torch.full((n,), uniform, dtype=kw["dtype"]))
    assert sampling._draw(probs, [None]).tolist() == [expected]
    assert sampling._draw(probs, [torch.Generator().manual_seed(0)]).tolist() == [expected]


# ---- nothing hangs, stop reasons, the instant engine's answers ---------------------------------


def _tiny_engine(path, max_batch_size=4):
    return HFEngine(
        EngineSettings(str(path), prompt_length=64, response_length=400, max_batch_size=max_batch_size, num_threads=1)
    )


TINY_PROMPTS = [[5, 9, 11, 7], [20, 3, 33], [40, 41, 42, 43, 44]]


async def _settled(engine, prompts, params, seconds=30.0):
    """Every request's outcome (tokens or the exception), or a TimeoutError when one hangs."""
    calls = [engine.generate(f"t{i}", prompt_ids=p, sampling_params=params) for i, p in enumerate(prompts)]
    return await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), seconds)


def test_a_failing_admission_fails_the_joining_requests_names_the_engine_and_recovers(tiny_model_dir):
    """Sampling the joiners' first tokens raises: they are in no batch yet, and must still hear."""
    engine = _tiny_engine(tiny_model_dir)
    original = engine._sample
    calls = {"n": 0}

    def broken_first_sample(seqs, logits):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected sampling failure")
        return original(seqs, logits)

    engine._sample = broken_first_sample
    try:
        outcomes = asyncio.run(_settled(engine, TINY_PROMPTS, {"temperature": 0, "max_tokens": 5}))
        assert all(isinstance(o, RuntimeError) for o in outcomes), outcomes
        assert all(
            re.search(r"transformers engine \(tiny-llama\w* on cpu\).*injected sampling failure", str(o))
            for o in outcomes
        ), outcomes
        # The engine serves the next requests.
        again = asyncio.run(_settled(engine, TINY_PROMPTS, {"temperature": 0, "max_tokens": 5}))
        assert [len(o.token_ids) for o in again] == [5, 5, 5]
    finally:
        engine.shutdown()


def _slow_forward(engine, seconds=0.05):
    original = engine.model.forward

    def slow(*args, **kwargs):
        time.sleep(seconds)
        return original(*args, **kwargs)

    engine.model.forward = slow


def test_shutdown_fails_every_waiting_request_in_the_batch_and_queued(tiny_model_dir):
    engine = _tiny_engine(tiny_model_dir, max_batch_size=1)
    _slow_forward(engine)
    params = {"temperature": 0, "max_tokens": 300, "ignore_eos": True}

    async def main():
        running = asyncio.ensure_future(_settled(engine, TINY_PROMPTS, params))
        while engine.stats["forward_steps"] < 3:
            await asyncio.sleep(0.02)
        # One request is in the batch (one slot), two are queued.
        await asyncio.to_thread(engine.shutdown)
        outcomes = await running
        with pytest.raises(ConnectionError, match="transformers engine .*has stopped"):
            await engine.generate("late", prompt_ids=TINY_PROMPTS[0], sampling_params=params)
        return outcomes

    outcomes = asyncio.run(main())
    assert all(isinstance(o, ConnectionError) for o in outcomes), outcomes
    assert all("transformers engine (tiny-llama" in str(o) and "shut down" in str(o) for o in outcomes), outcomes


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_decode_loop_that_dies_fails_every_waiting_request(tiny_model_dir):
    """A bug that escapes the step's own handling ends the loop: nobody may wait on it."""

    class LoopBug(BaseException):
        pass

    engine = _tiny_engine(tiny_model_dir, max_batch_size=1)
    _slow_forward(engine)
    original = engine._step
    steps = {"n": 0}

    def dies_on_the_third_step(batch):
        steps["n"] += 1
        if steps["n"] == 3:
            raise LoopBug("injected")
        return original(batch)

    engine._step = dies_on_the_third_step
    try:
        outcomes = asyncio.run(
            _settled(engine, TINY_PROMPTS, {"temperature": 0, "max_tokens": 300, "ignore_eos": True})
        )
    finally:
        engine.shutdown()
    assert all(isinstance(o, ConnectionError) and "decode loop ended" in str(o) for o in outcomes), outcomes


def test_the_transformers_engine_says_why_a_response_stopped(tiny_model_dir):
    engine = _tiny_engine(tiny_model_dir)
    greedy = {"temperature": 0, "max_tokens": 6}
    try:
        [ignored] = asyncio.run(_settled(engine, TINY_PROMPTS[:1], dict(greedy, ignore_eos=True)))
        assert ignored.stop_reason == "length" and len(ignored.token_ids) == 6
        # An EOS the model never picks here: the budget ends the response.
        engine.eos_token_ids = [next(t for t in range(3, 64) if t not in ignored.token_ids)]
        [budget] = asyncio.run(_settled(engine, TINY_PROMPTS[:1], greedy))
        assert budget.stop_reason == "length" and budget.token_ids == ignored.token_ids
        # Its third token made an EOS: the response ends at that token's first occurrence.
        engine.eos_token_ids = [ignored.token_ids[2]]
        [eos] = asyncio.run(_settled(engine, TINY_PROMPTS[:1], greedy))
        assert eos.stop_reason == "stop"
        assert eos.token_ids == ignored.token_ids[: ignored.token_ids.index(ignored.token_ids[2]) + 1]
    finally:
        engine.shutdown()


def _instant(prompt, **params):
    engine = InstantEngine(
        InstantSettings(prompt_length=64, response_length=32, eos_token_id=2, response_tokens=8, vocab_size=500)
    )
    return asyncio.run(engine.generate("any-id", prompt_ids=prompt, sampling_params=params))


def test_the_instant_engine_answers_per_prompt_seed_and_temperature_and_says_why_it_stopped():
    prompt = [11, 12, 13, 14]
    # The n samples of one prompt (each with its own seed) differ; the same request repeats exactly.
    samples = [_instant(prompt, temperature=1.0, seed=n).token_ids for n in range(4)]
    assert len({tuple(s) for s in samples}) == 4
    assert [_instant(prompt, temperature=1.0, seed=n).token_ids for n in range(4)] == samples
    assert _instant(prompt, temperature=0.7, seed=0).token_ids != samples[0]
    assert _instant([11, 12, 14, 13], temperature=1.0, seed=0).token_ids != samples[0], (
        "the prompt's order counts, not its sum"
    )
    # Greedy: the prompt alone decides, as a model's argmax does.
    assert _instant(prompt, temperature=0, seed=1).token_ids == _instant(prompt, temperature=0, seed=2).token_ids
    full = _instant(prompt, temperature=1.0, seed=0)
    assert full.stop_reason == "stop" and len(full.token_ids) == 8 and full.token_ids[-1] == 2
    capped = _instant(prompt, temperature=1.0, seed=0, max_tokens=3)
    assert capped.stop_reason == "length" and capped.token_ids == full.token_ids[:3]


@pytest.mark.parametrize("later_turns_first", [True, False], ids=["later-turns-first", "arrival-order"])
def test_a_trajectorys_next_turn_joins_before_first_turns_that_wait(model_dir, prompts, later_turns_first):
    """One slot: while a long request holds it, first turns "b" and "c" queue, then trajectory "a"
    (which ran before) sends its next turn: it runs right after the long request, ahead of b and
    c; with later_turns_first=false, in arrival order. As the routing client sends turns: a fresh
    request id each time, the trajectory's own id as `trajectory_key`."""
    engine = HFEngine(
        EngineSettings(
            str(model_dir),
            prompt_length=256,
            response_length=64,
            max_batch_size=1,
            num_threads=2,
            later_turns_first=later_turns_first,
        )
    )
    short = {"temperature": 0, "max_tokens": 2, "ignore_eos": True}
    finished = []

    async def turn(trajectory, prompt, params):
        output = await engine.generate(
            uuid.uuid4().hex, prompt_ids=prompt, sampling_params=params, trajectory_key=trajectory
        )
        finished.append(trajectory)
        return output

    async def until(condition):
        while not condition():
            await asyncio.sleep(0.005)

    async def main():
        first = await turn("a", prompts[0], short)
        tokens_before = engine.stats["generated_tokens"]
        long = asyncio.create_task(turn("long", prompts[1], {"temperature": 0, "max_tokens": 60, "ignore_eos": True}))
        await until(lambda: engine.stats["generated_tokens"] > tokens_before)  # it holds the slot
        queued = [
            asyncio.create_task(turn(name, prompt, short)) for name, prompt in (("b", prompts[2]), ("c", prompts[3]))
        ]
        await until(lambda: engine._incoming.qsize() == 2)
        queued.append(asyncio.create_task(turn("a", prompts[0] + first.token_ids + prompts[3][-4:], short)))
        await until(lambda: engine._incoming.qsize() == 3)
        assert not long.done(), "the long request ended before every other request queued: the order shows nothing"
        await asyncio.gather(long, *queued)

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()
    assert finished[:2] == ["a", "long"]
    assert finished[2:] == (["a", "b", "c"] if later_turns_first else ["b", "c", "a"])
    assert engine.stats["later_turns"] == (1 if later_turns_first else 0)
