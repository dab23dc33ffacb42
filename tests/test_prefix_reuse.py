"""Prefix reuse in the transformers engine: a turn that extends a finished sequence prefills only
its new tokens, and answers exactly what an engine without reuse answers (and the model itself);
interleaved conversations, a byte budget that evicts, prompts that only share part of a cached
sequence, and a system prompt shared by a batch of prompts."""

import asyncio

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from generation_core.engines.hf.engine import EngineSettings, HFEngine

pytestmark = pytest.mark.timeout(300)

# The tool turn as the bundled tokenizer's ChatML template renders it after a call.
TOOL_TURN = "<|im_start|>tool\n{}<|im_end|>\n<|im_start|>assistant\n"
QUESTIONS = [
    "What is 2 + 2?",
    "Name a color.",
    "Describe rain in one line.",
    "What is the capital of Italy?",
    "Say hi.",
    "Count to three.",
]


def _engine(model_dir, prefix_cache_bytes, max_batch_size=4):
    return HFEngine(
        EngineSettings(
            str(model_dir),
            prompt_length=1024,
            response_length=32,
            max_batch_size=max_batch_size,
            num_threads=2,
            prefix_cache_bytes=prefix_cache_bytes,
        )
    )


@pytest.fixture(scope="module")
def reuse(model_dir):
    engine = _engine(model_dir, 512 * 1024 * 1024)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def plain(model_dir):
    engine = _engine(model_dir, 0)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(str(model_dir))


def _chat(tokenizer, text):
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    return ids if isinstance(ids, list) else list(ids["input_ids"])


def _tool(tokenizer, text):
    return tokenizer.encode(TOOL_TURN.format(text), add_special_tokens=False)


def _run(engine, prompt, max_tokens=12, **params):
    params = {"temperature": 0, "logprobs": True, "max_tokens": max_tokens, **params}
    return asyncio.run(engine.generate("r", prompt_ids=prompt, sampling_params=params))


def _assert_same(a, b):
    assert a.token_ids == b.token_ids
    assert max((abs(x - y) for x, y in zip(a.log_probs, b.log_probs, strict=True)), default=0.0) < 1e-4


def _delta(engine, before, keys=("prefix_hits", "prefix_misses", "prefix_reused_tokens", "prefill_tokens")):
    return {k: engine.stats[k] - before[k] for k in keys}


def test_a_second_turn_prefills_only_its_new_tokens_and_answers_the_same(reuse, plain, tokenizer, model_dir):
    first = _chat(tokenizer, "What is 17 times 3? Use the calculator.")
    before = dict(reuse.stats)
    turn1 = _run(reuse, first, max_tokens=10, ignore_eos=True)
    second = first + turn1.token_ids + _tool(tokenizer, "51")
    turn2 = _run(reuse, second, max_tokens=16, ignore_eos=True)
    # The KV of the first turn's last token was never computed: everything before it is reused.
    # (The first turn may reuse the chat header it shares with prompts the module ran before.)
    reused = len(first) + len(turn1.token_ids) - 1
    shared = _delta(reuse, before, ("shared_prefix_tokens",))["shared_prefix_tokens"]
    assert _delta(reuse, before) == {
        "prefix_hits": 1,
        "prefix_misses": 1,
        "prefix_reused_tokens": reused,
        "prefill_tokens": len(first) - shared + len(second) - reused,
    }

    plain_turn1 = _run(plain, first, max_tokens=10, ignore_eos=True)
    _assert_same(turn1, plain_turn1)
    _assert_same(turn2, _run(plain, second, max_tokens=16, ignore_eos=True))
    # And the model itself, the whole conversation in one forward.
    reference = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    with torch.no_grad():
        expected = reference.generate(
            torch.tensor([second]),
            attention_mask=torch.ones(1, len(second), dtype=torch.long),
            max_new_tokens=16,
            do_sample=False,
            pad_token_id=2,
        )
    expected = expected[0, len(second) :].tolist()
    # generate stops at the end of turn, where ignore_eos goes on.
    assert turn2.token_ids[: len(expected)] == expected and (len(expected) == 16 or expected[-1] == 2)


def _conversations(engine, tokenizer, turns=3):
    """Six conversations, started at staggered times, each turn extending the last (a batch of
    four: some wait in the queue and join a running batch)."""

    async def conversation(i):
        await asyncio.sleep(0.07 * i)
        prompt = _chat(tokenizer, QUESTIONS[i])
        outputs = []
        for turn in range(turns):
            params = {"temperature": 0, "logprobs": True, "max_tokens": 4 + 3 * i + 2 * turn}
            out = await engine.generate(f"c{i}", prompt_ids=prompt, sampling_params=params)
            outputs.append((prompt, out))
            prompt = prompt + out.token_ids + _tool(tokenizer, f"result {i}.{turn}")
        return outputs

    async def main():
        return await asyncio.gather(*[conversation(i) for i in range(len(QUESTIONS))])

    return asyncio.run(main())


def test_interleaved_conversations_answer_the_same_with_and_without_reuse(reuse, plain, tokenizer):
    before = dict(reuse.stats)
    with_reuse = _conversations(reuse, tokenizer)
    stats = _delta(reuse, before)
    without = _conversations(plain, tokenizer)
    for conv_reuse, conv_plain in zip(with_reuse, without, strict=True):
        for (prompt_a, a), (prompt_b, b) in zip(conv_reuse, conv_plain, strict=True):
            assert prompt_a == prompt_b
            _assert_same(a, b)
    # Every later turn finds its own conversation's previous turn, and nothing else.
    later = [(prompt, out) for conv in with_reuse for prompt, out in conv[:-1]]
    assert stats["prefix_hits"] == len(later) == 12
    assert stats["prefix_misses"] == len(QUESTIONS)
    assert stats["prefix_reused_tokens"] == sum(len(prompt) + len(out.token_ids) - 1 for prompt, out in later)
    assert plain.stats["prefix_hits"] == 0 and plain._prefix_cache is None


def test_the_byte_budget_evicts_and_nothing_larger_is_kept(model_dir, plain, tokenizer):
    config = AutoConfig.from_pretrained(str(model_dir))
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    token_bytes = config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim * 4
    a, b = _chat(tokenizer, "Name a fruit."), _chat(tokenizer, "Name a tree.")
    # Room for one first turn (8 tokens generated, 7 of them cached), not two.
    budget = token_bytes * (max(len(a), len(b)) + 7)
    engine = _engine(model_dir, budget)
    try:
        cache = engine._prefix_cache
        a1 = _run(engine, a, max_tokens=8, ignore_eos=True)
        b1 = _run(engine, b, max_tokens=8, ignore_eos=True)
        assert len(cache) == 1 and cache.nbytes == token_bytes * (len(b) + 7) <= budget
        # a's first turn was evicted by b's: a miss. Its second turn is larger than the budget:
        # not kept, and b's entry stays.
        a2_prompt = a + a1.token_ids + _tool(tokenizer, "apple")
        a2 = _run(engine, a2_prompt, max_tokens=8, ignore_eos=True)
        assert len(cache) == 1 and cache.nbytes <= budget
        b2_prompt = b + b1.token_ids + _tool(tokenizer, "oak")
        b2 = _run(engine, b2_prompt, max_tokens=8, ignore_eos=True)
        assert engine.stats["prefix_hits"] == 1 and engine.stats["prefix_misses"] == 3
        assert engine.stats["prefix_reused_tokens"] == len(b) + 7
        assert len(cache) == 0 and cache.nbytes == 0
        for out, prompt in ((a1, a), (b1, b), (a2, a2_prompt), (b2, b2_prompt)):
            _assert_same(out, _run(plain, prompt, max_tokens=8, ignore_eos=True))
    finally:
        engine.shutdown()
    # A budget no sequence fits: nothing kept, every prompt prefilled whole, the same answers.
    engine = _engine(model_dir, 1)
    try:
        out = _run(engine, a2_prompt, max_tokens=8, ignore_eos=True)
        again = _run(engine, a2_prompt + out.token_ids, max_tokens=8, ignore_eos=True)
        assert (
            len(engine._prefix_cache) == 0 and engine.stats["prefix_hits"] == 0 and engine.stats["prefix_misses"] == 2
        )
        _assert_same(out, a2)
        _assert_same(again, _run(plain, a2_prompt + out.token_ids, max_tokens=8, ignore_eos=True))
    finally:
        engine.shutdown()


def test_a_prompt_that_only_shares_part_of_a_sequence_reuses_that_part_and_leaves_it(reuse, plain, tokenizer):
    first = _chat(tokenizer, "Tell me about the sea.")
    turn1 = _run(reuse, first, max_tokens=12, ignore_eos=True)
    cached = first + turn1.token_ids[:-1]
    diverging = first + turn1.token_ids[:4] + _tool(tokenizer, "waves")
    assert diverging[len(first) + 4] != turn1.token_ids[4]
    # Diverges in the middle of the cached sequence, or stops inside it: the common part is
    # reused (no turn of this trajectory: not taken), and the entry stays for its own next turn.
    for prompt, common in ((diverging, len(first) + 4), (first + turn1.token_ids[:5], len(first) + 4)):
        before = dict(reuse.stats)
        _assert_same(_run(reuse, prompt), _run(plain, prompt))
        delta = _delta(reuse, before, ("prefix_hits", "shared_prefix_hits", "shared_prefix_tokens", "prefill_tokens"))
        assert delta == {
            "prefix_hits": 0,
            "shared_prefix_hits": 1,
            "shared_prefix_tokens": common,
            "prefill_tokens": len(prompt) - common,
        }
    # Exactly the cached sequence: all of it but the last token is reused (that one gives the logits).
    before = dict(reuse.stats)
    _assert_same(_run(reuse, cached), _run(plain, cached))
    delta = _delta(reuse, before)
    assert (
        delta["prefix_hits"] == 1 and delta["prefix_reused_tokens"] == len(cached) - 1 and delta["prefill_tokens"] == 1
    )


def test_prompts_that_start_alike_prefill_the_common_start_once(model_dir, plain, tokenizer):
    """Eight prompts behind one long system prompt, sent at once: the first is prefilled whole,
    the others wait one step and reuse its KV for everything they share; same answers."""
    system = "You are a calculator assistant. Think step by step, then answer with one number. " * 3
    prompts = []
    for q in QUESTIONS[:4] * 2:
        ids = tokenizer.apply_chat_template(
            [{"role": "system", "content": system}, {"role": "user", "content": q}],
            add_generation_prompt=True,
            tokenize=True,
        )
        prompts.append(ids if isinstance(ids, list) else list(ids["input_ids"]))
    engine = _engine(model_dir, 512 * 1024 * 1024, max_batch_size=8)
    try:
        params = {"temperature": 0, "logprobs": True, "max_tokens": 6, "ignore_eos": True}

        async def main(target):
            return await asyncio.gather(
                *[target.generate(f"p{i}", prompt_ids=p, sampling_params=params) for i, p in enumerate(prompts)]
            )

        shared = asyncio.run(main(engine))
        alone = asyncio.run(main(plain))
        for a, b in zip(shared, alone, strict=True):
            _assert_same(a, b)
        common = next(i for i in range(min(map(len, prompts))) if len({p[i] for p in prompts}) > 1)
        assert common > 40, common
        assert engine.stats["shared_prefix_hits"] == 7
        # Each later prompt reuses at least the part all eight share (the same question twice: all but one token).
        assert engine.stats["shared_prefix_tokens"] >= 7 * common
        assert engine.stats["prefill_tokens"] == sum(map(len, prompts)) - engine.stats["shared_prefix_tokens"]
    finally:
        engine.shutdown()
