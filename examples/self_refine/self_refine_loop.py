"""A custom verl agent loop: answer, critique, revise.

The model answers the prompt; a user turn asks it to critique its answer; it critiques; a
second user turn asks for a revised answer; it revises. Each model turn gets an equal share of
what remains of `response_length`. The trajectory's response holds all
three model turns with mask 1 and the two user turns with mask 0 (and logprob 0), so training
only learns from what the model wrote. `extra_fields["self_refine_turns"]` records the length of
each turn (model, user, model, user, model) for analysis.

It is a plain `AgentLoopBase` subclass written as a small state machine, one handler per state,
like verl's ToolAgentLoop. Two ways to make it known to every Ray worker of a run:

* a `verl.plugins` entry point naming this module in the pyproject of the package that ships
  it (`@register` below runs when `import verl` loads the plugin):
  `actor_rollout_ref.rollout.agent.default_agent_loop=self_refine`
* the YAML beside this file: `actor_rollout_ref.rollout.agent.agent_loop_config_path=
  examples/self_refine/agent_loop.yaml` (its `self_refine_yaml` entry also sets the prompts).
"""

from __future__ import annotations

from enum import Enum
from typing import Any
from uuid import uuid4

from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopOutput, register
from verl.utils.profiler import simple_timer

CRITIQUE_REQUEST = "Critique your answer above in one or two sentences: what is wrong or missing?"
REVISE_REQUEST = "Now write an improved final answer that fixes those problems."


class State(Enum):
    ANSWER = "answer"
    ASK_CRITIQUE = "ask_critique"
    CRITIQUE = "critique"
    ASK_REVISION = "ask_revision"
    REVISE = "revise"
    DONE = "done"


class _Trajectory:
    """Everything one rollout accumulates: the running token ids and the response metadata."""

    def __init__(self, messages: list[dict[str, Any]]):
        self.messages = messages
        self.token_ids: list[int] = []
        self.response_mask: list[int] = []
        self.response_logprobs: list[float] | None = None
        self.turn_lengths: list[int] = []
        self.model_turns = 0
        self.user_turns = 0
        self.metrics: dict[str, Any] = {}


@register("self_refine")
class SelfRefineAgentLoop(AgentLoopBase):
    def __init__(self, *args, critique_request: str = CRITIQUE_REQUEST, revise_request: str = REVISE_REQUEST, **kwargs):
        super().__init__(*args, **kwargs)
        self.critique_request = critique_request
        self.revise_request = revise_request
        self.response_length = self.rollout_config.response_length
        # The third argument of a model turn: how many model turns remain, itself included.
        self.handlers = {
            State.ANSWER: lambda t, p: self._generate(t, p, 3, State.ASK_CRITIQUE),
            State.ASK_CRITIQUE: lambda t, p: self._ask(t, self.critique_request, State.CRITIQUE),
            State.CRITIQUE: lambda t, p: self._generate(t, p, 2, State.ASK_REVISION),
            State.ASK_REVISION: lambda t, p: self._ask(t, self.revise_request, State.REVISE),
            State.REVISE: lambda t, p: self._generate(t, p, 1, State.DONE),
        }

    async def run(self, sampling_params: dict[str, Any], **kwargs) -> AgentLoopOutput:
        trajectory = _Trajectory(list(kwargs["raw_prompt"]))
        trajectory.token_ids = await self.ct_build_initial_tokens(trajectory.messages)
        prompt_ids = list(trajectory.token_ids)
        request_id = uuid4().hex
        state = State.ANSWER
        while state is not State.DONE:
            state = await self.handlers[state](trajectory, (sampling_params, request_id))
            if len(trajectory.response_mask) >= self.response_length:
                state = State.DONE

        response_ids = trajectory.token_ids[len(prompt_ids) :]
        logprobs = trajectory.response_logprobs
        output = AgentLoopOutput(
            prompt_ids=prompt_ids,
            response_ids=response_ids[: self.response_length],
            response_mask=trajectory.response_mask[: self.response_length],
            response_logprobs=logprobs[: self.response_length] if logprobs else None,
            num_turns=1 + trajectory.user_turns + trajectory.model_turns,
            metrics=trajectory.metrics,
        )
        output.extra_fields.update(
            {"turn_scores": [], "tool_rewards": [], "self_refine_turns": trajectory.turn_lengths}
        )
        return output

    async def _generate(
        self, trajectory: _Trajectory, request: tuple[dict[str, Any], str], turns_left: int, next_state: State
    ) -> State:
        sampling_params, request_id = request
        # Share what is left of response_length among the remaining model turns, so the first
        # answer cannot use it all (max_tokens is honoured by verl's SGLang/vLLM servers too).
        budget = max(1, (self.response_length - len(trajectory.response_mask)) // turns_left)
        sampling_params = {**sampling_params, "max_tokens": min(budget, sampling_params.get("max_tokens") or budget)}
        with simple_timer("generate_sequences", trajectory.metrics):
            output = await self.server_manager.generate(
                request_id=request_id, prompt_ids=trajectory.token_ids, sampling_params=sampling_params
            )
        before = len(trajectory.response_mask)
        wants_logprobs = trajectory.response_logprobs is not None or bool(output.log_probs)
        merged, trajectory.response_mask, logprobs = await self.ct_merge_assistant_token(
            trajectory.token_ids,
            output.token_ids,
            trajectory.response_mask,
            (trajectory.response_logprobs or []) if wants_logprobs else None,
            assistant_logprobs=output.log_probs or None,
        )
        trajectory.token_ids = merged.token_ids
        if logprobs is not None:
            trajectory.response_logprobs = logprobs
        trajectory.turn_lengths.append(len(trajectory.response_mask) - before)
        trajectory.model_turns += 1
        text = self.tokenizer.decode(output.token_ids, skip_special_tokens=True)
        trajectory.messages.append({"role": "assistant", "content": text})
        return next_state

    async def _ask(self, trajectory: _Trajectory, request_text: str, next_state: State) -> State:
        previous = list(trajectory.messages)
        trajectory.messages.append({"role": "user", "content": request_text})
        before = len(trajectory.response_mask)
        merged, trajectory.response_mask, logprobs = await self.ct_merge_context_msg(
            previous, trajectory.messages, trajectory.token_ids, trajectory.response_mask, trajectory.response_logprobs
        )
        trajectory.token_ids = merged.token_ids
        if trajectory.response_logprobs is not None:
            trajectory.response_logprobs = logprobs or []
        trajectory.turn_lengths.append(len(trajectory.response_mask) - before)
        trajectory.user_turns += 1
        return next_state
