"""A deterministic scripted engine for agent-loop tests (no model).

It speaks verl's client contract (`await generate(request_id, *, prompt_ids, sampling_params)
-> TokenOutput`). Before any tool turn in the prompt it answers with a hermes tool call to the
calculator, after one with the final answer; every generated token gets log-probability -0.5 - 0.01 * position,
so logprobs are aligned and distinguishable. `failures` maps a piece of prompt text to how many
times requests for prompts containing it raise (None: always), to inject engine errors for
chosen samples.
"""

from __future__ import annotations

from verl.workers.rollout.replica import TokenOutput

TOOL_CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "EXPR"}}\n</tool_call>'
ANSWER = "The answer is RESULT."


class EngineCrashed(RuntimeError):
    """What the scripted engine raises for an injected failure."""


class ScriptedEngine:
    def __init__(
        self, tokenizer, expressions: dict[str, str] | None = None, failures: dict[str, int | None] | None = None
    ):
        self.tokenizer = tokenizer
        self.expressions = expressions or {}
        self.failures = dict(failures or {})
        self.calls: list[list[int]] = []
        self.failed_calls = 0

    def turn_text(self, prompt_text: str) -> str:
        expression = next((e for q, e in self.expressions.items() if q in prompt_text), "2+3")
        # ChatML (the bundled tokenizer): a tool turn in the prompt means the tool has answered.
        if "<|im_start|>tool" not in prompt_text:
            return TOOL_CALL.replace("EXPR", expression)
        return ANSWER.replace("RESULT", str(eval(expression)))  # noqa: S307 - the test's own expressions

    def turn_tokens(self, prompt_text: str) -> list[int]:
        return self.tokenizer.encode(self.turn_text(prompt_text), add_special_tokens=False) + [
            self.tokenizer.eos_token_id
        ]

    @staticmethod
    def logprobs(count: int) -> list[float]:
        return [-0.5 - 0.01 * i for i in range(count)]

    async def generate(self, request_id, *, prompt_ids, sampling_params, **_unused) -> TokenOutput:
        self.calls.append(list(prompt_ids))
        prompt_text = self.tokenizer.decode(prompt_ids)
        for piece, remaining in self.failures.items():
            if piece in prompt_text and (remaining is None or remaining > 0):
                if remaining is not None:
                    self.failures[piece] = remaining - 1
                self.failed_calls += 1
                raise EngineCrashed(f"injected engine failure for a prompt with {piece!r}")
        tokens = self.turn_tokens(prompt_text)
        return TokenOutput(
            token_ids=tokens,
            log_probs=self.logprobs(len(tokens)) if sampling_params.get("logprobs") else None,
            stop_reason="completed",
        )
