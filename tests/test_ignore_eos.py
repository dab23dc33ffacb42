"""verl's `actor_rollout_ref.rollout.ignore_eos`: genrun sends it with every request, so every
engine runs each response to its budget (verl's own agent loop leaves it to the vLLM server's
config, and its SGLang server ignores the key); off, no request carries it."""

import pytest

from tests.test_sample_seed import _responses

pytestmark = pytest.mark.timeout(120)


def test_ignore_eos_goes_with_every_request_and_responses_run_to_their_budget(model_dir):
    responses, seen = _responses(model_dir, "actor_rollout_ref.rollout.ignore_eos=true", "data.max_response_length=16")
    assert all(params["ignore_eos"] is True for params in seen) and len(seen) == 4
    assert [len(r) for r in responses] == [16] * 4


def test_without_ignore_eos_no_request_asks_for_it(model_dir):
    responses, seen = _responses(model_dir, "data.max_response_length=16")
    assert all("ignore_eos" not in params for params in seen)
    assert all(len(r) < 16 for r in responses), "the instant engine's short completion, ended by EOS"
