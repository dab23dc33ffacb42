"""Weight-first linear layers (engines/hf/cpu_linear.py): the same outputs as nn.Linear, on exactly the
layers they should replace, and the engine's setting that turns them on and off."""

import asyncio

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from generation_core.engines.hf.cpu_linear import use_plain_linears, use_weight_first_linears, weight_first_forward
from generation_core.engines.hf.engine import EngineSettings, HFEngine

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("shape", [(1, 16), (1, 1, 16), (2, 16), (3, 5, 16), (7, 1, 16)], ids=str)
def test_weight_first_forward_is_nn_linear(shape, bias):
    torch.manual_seed(0)
    layer = nn.Linear(16, 11, bias=bias)
    x = torch.randn(*shape)
    got = weight_first_forward(layer, x)
    assert got.shape == (*shape[:-1], 11)
    assert got.is_contiguous()
    torch.testing.assert_close(got, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-6)


def test_wider_calls_than_max_rows_run_nn_linear(monkeypatch):
    layer = nn.Linear(16, 11)
    calls = []
    monkeypatch.setattr(torch, "addmm", lambda *a, **k: calls.append("addmm") or torch.ops.aten.addmm(*a, **k))
    weight_first_forward(layer, torch.randn(4, 16), max_rows=4)
    assert calls == ["addmm"]
    weight_first_forward(layer, torch.randn(5, 16), max_rows=4)
    weight_first_forward(layer, torch.randn(1, 16), max_rows=4)
    assert calls == ["addmm"]


def test_a_strided_input_gives_the_same_rows():
    torch.manual_seed(1)
    layer = nn.Linear(8, 6)
    x = torch.randn(4, 9, 8)[:, ::2]  # not contiguous
    torch.testing.assert_close(
        weight_first_forward(layer, x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-6
    )


class _Adapter(nn.Linear):
    """A subclass with its own forward (as quantized and adapter layers have): left alone."""

    def forward(self, x):
        return super().forward(x) + 1


def test_only_plain_float_linears_on_the_cpu_are_replaced_once_and_can_be_restored():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), _Adapter(4, 4), nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2)))
    assert use_weight_first_linears(model) == 3
    assert use_weight_first_linears(model) == 0  # already replaced
    replaced = [m for m in model.modules() if "forward" in vars(m)]
    assert replaced == [model[0], model[3][0], model[3][1]]
    x = torch.randn(5, 4)
    with torch.no_grad():
        weight_first = model(x)
        use_plain_linears(model)
        assert not any("forward" in vars(m) for m in model.modules())
        torch.testing.assert_close(weight_first, model(x), rtol=1e-5, atol=1e-6)


def test_a_llama_gives_the_same_logits_and_greedy_tokens():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = LlamaForCausalLM(config).eval()
    ids = torch.randint(3, 97, (3, 12))
    with torch.no_grad():
        plain = model(ids).logits
        plain_tokens = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
        assert use_weight_first_linears(model) == 2 * 7 + 1  # q, k, v, o, gate, up, down per layer; lm_head
        torch.testing.assert_close(model(ids).logits, plain, rtol=1e-4, atol=1e-5)
        assert torch.equal(model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0), plain_tokens)


@pytest.mark.parametrize("weight_first", [True, False], ids=["weight-first", "nn-linear"])
def test_the_engine_setting_decides_and_both_give_the_greedy_tokens(tiny_model_dir, weight_first):
    settings = EngineSettings(
        str(tiny_model_dir),
        prompt_length=64,
        response_length=16,
        max_batch_size=4,
        num_threads=1,
        weight_first_linear=weight_first,
    )
    engine = HFEngine(settings)
    try:
        replaced = [m for m in engine.model.modules() if "forward" in vars(m)]
        assert len(replaced) == (2 * 7 + 1 if weight_first else 0)
        prompts = [[5, 9, 11, 7], [20, 3, 33], [40, 41, 42, 43, 44]]

        async def main():
            params = {"temperature": 0, "max_tokens": 10, "ignore_eos": True}
            return await asyncio.gather(
                *[engine.generate(f"r{i}", prompt_ids=p, sampling_params=params) for i, p in enumerate(prompts)]
            )

        outputs = asyncio.run(asyncio.wait_for(main(), 60))
        use_plain_linears(engine.model)
        for prompt, out in zip(prompts, outputs, strict=True):
            with torch.no_grad():
                expected = engine.model.generate(
                    torch.tensor([prompt]), max_new_tokens=10, do_sample=False, pad_token_id=0, eos_token_id=None
                )
            assert out.token_ids == expected[0, len(prompt) :].tolist()
    finally:
        engine.shutdown()
