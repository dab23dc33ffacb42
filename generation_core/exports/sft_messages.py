"""A trajectory's chat messages, rebuilt from its token segments with the run's tokenizer.

A record holds the prompt's chat messages (the dataset row's `raw_prompt`) and one token stream
after the prompt, where `response_mask` tells the model's tokens (1) from the tokens the agent
loop added (0): tool answers and user turns, rendered by the chat template together with the
template's own scaffolding (`<|im_start|>tool\\n ... <|im_end|>\\n<|im_start|>assistant\\n` in
ChatML). So:
- every run of mask-1 tokens is one assistant message: its text, decoded as it is (special
  tokens kept, no clean-up of spaces), without the end-of-sequence token that closed the turn;
  the template adds that token back when it renders the message;
- every run of mask-0 tokens is one or more tool or user messages: the run's text is matched
  against the template's rendering of such messages (`ContextTurnShape`, learned once per
  tokenizer by rendering marker messages) and the contents are cut out of it.

Where the rebuilt messages cannot give the tokens back: a last turn cut at the length limit has
no end-of-sequence token (`RebuiltTrajectory.truncated`; rendering the messages adds one), and a
mask-0 run the template's shapes do not explain is kept whole, as raw text in a user message
(`RebuiltTrajectory.unmatched_turns` counts them). Multi-turn streams also differ from a
rendering of the whole conversation at the turn boundaries where verl's continuous-token builder
joins turns (e.g. no newline after the `<|im_end|>` that ended an assistant turn).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from generation_core.errors import GenrunError

# Marker contents: plain ASCII words that no template rewrites and no tokenizer needs to merge.
_MARKERS = ("GENRUNMARKERFIRST", "GENRUNMARKERSECOND")
# A prefix conversation the probes render after: system first, so templates that add a default
# system prompt render the same head in both renderings.
_PROBE_HEAD = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
CONTEXT_ROLES = ("tool", "user")
"""The roles a mask-0 run is matched against, in this order (a template may render a tool
answer as a user turn with extra tags: the more specific shape is tried first)."""


@dataclass(frozen=True)
class ContextTurnShape:
    """How the chat template renders appended messages of one role after an assistant turn:
    `lead` + content + (`between` + content)* + `trail` (`trail` ends with the generation prompt)."""

    role: str
    lead: str
    between: str
    trail: str

    def contents(self, text: str) -> list[str] | None:
        """The message contents `text` renders, or None when it does not have this shape. Text
        before `lead` may only be whitespace: a boundary token some builders insert (Qwen adds
        the newline a stopped `<|im_end|>` lacks)."""
        start = text.find(self.lead)
        if (
            start < 0
            or text[:start].strip()
            or not text.endswith(self.trail)
            or start + len(self.lead) > len(text) - len(self.trail)
        ):
            return None
        middle = text[start + len(self.lead) : len(text) - len(self.trail)]
        return middle.split(self.between) if self.between else [middle]


@dataclass
class RebuiltTrajectory:
    messages: list[dict[str, str]]
    """The prompt's messages, then the rebuilt turns, each {"role", "content"}."""
    prompt_messages: int
    """How many of `messages` are the prompt's."""
    truncated: bool
    """The last assistant turn has no end-of-sequence token (cut at the length limit)."""
    unmatched_turns: int = 0
    """Mask-0 runs the template's tool/user shapes did not explain (kept as raw user text)."""
    dropped_prompt_keys: frozenset[str] = frozenset()
    """Keys of the prompt's messages other than role and content (`name`, `tool_calls`, ...): the
    layouts hold {"role", "content"} only, so the export says which it left out."""

    @property
    def prompt(self) -> list[dict[str, str]]:
        return self.messages[: self.prompt_messages]

    @property
    def response(self) -> list[dict[str, str]]:
        return self.messages[self.prompt_messages :]


class MessageRebuilder:
    """Turns a record's (prompt messages, response ids, response mask) into chat messages."""

    def __init__(
        self,
        tokenizer,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        eos_token_ids: set[int] | None = None,
    ):
        self.tokenizer = tokenizer
        self.tools = tools or None
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.eos_token_ids = set(eos_token_ids or ()) | (
            {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
        )
        self.shapes = [shape for role in CONTEXT_ROLES if (shape := self._probe(role)) is not None]
        self.keep_parts = False
        """Keep a prompt message's content list (a run with images: exports/sft_images.py)."""

    def _render(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages,
            tools=self.tools,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **self.chat_template_kwargs,
        )

    def _probe(self, role: str) -> ContextTurnShape | None:
        """The shape of `role` messages appended after an assistant turn, learnt from the
        template (None when the template refuses such messages)."""
        assistant: dict[str, Any] = {"role": "assistant", "content": "A"}
        if role == "tool":
            # Templates may expect the tool answer to follow a call (verl's builder renders tool
            # groups after a synthetic calling assistant the same way).
            assistant["tool_calls"] = [
                {"id": f"call_{i}", "type": "function", "function": {"name": "tool", "arguments": {}}}
                for i in range(len(_MARKERS))
            ]
        head = [*_PROBE_HEAD, assistant]
        probes = [{"role": role, "content": marker} for marker in _MARKERS]
        if role == "tool":
            for i, probe in enumerate(probes):
                probe["tool_call_id"] = f"call_{i}"
        try:
            before = self._render(head, add_generation_prompt=False)
            one = self._render([*head, probes[0]], add_generation_prompt=True)
            two = self._render([*head, *probes], add_generation_prompt=True) if role == "tool" else None
        except Exception:  # noqa: BLE001 - a template may raise for a role it does not know (jinja's raise_exception)
            return None
        if not one.startswith(before) or _MARKERS[0] not in one:
            return None
        lead, _, trail = one[len(before) :].partition(_MARKERS[0])
        between = ""
        if two is not None and two.startswith(before + lead + _MARKERS[0]) and _MARKERS[1] in two:
            rest = two[len(before + lead + _MARKERS[0]) :]
            between, _, two_trail = rest.partition(_MARKERS[1])
            if two_trail != trail:
                between = ""
        return ContextTurnShape(role, lead, between, trail)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def context_messages(self, text: str) -> tuple[list[dict[str, str]], bool]:
        """(messages, matched) for the text of one mask-0 run."""
        for shape in self.shapes:
            contents = shape.contents(text)
            if contents is not None:
                return [{"role": shape.role, "content": content} for content in contents], True
        return [{"role": "user", "content": text}], False

    def rebuild(
        self, prompt: list[dict[str, Any]], response_ids: list[int], response_mask: list[int]
    ) -> RebuiltTrajectory:
        turns: list[dict[str, str]] = []
        truncated, unmatched = False, 0
        for is_model, ids in _runs(response_ids, response_mask):
            if is_model:
                ended = ids[-1] in self.eos_token_ids
                turns.append({"role": "assistant", "content": self.decode(ids[:-1] if ended else ids)})
                truncated = not ended
            else:
                messages, matched = self.context_messages(self.decode(ids))
                turns.extend(messages)
                unmatched += not matched
        prompt_messages = prompt_chat_messages(prompt, self.keep_parts)
        return RebuiltTrajectory(
            [*prompt_messages, *turns], len(prompt_messages), truncated, unmatched, extra_message_keys(prompt)
        )


def _runs(ids: list[int], mask: list[int]):
    """(mask value == 1, ids) for each run of equal mask values."""
    start = 0
    for position in range(1, len(ids) + 1):
        if position == len(ids) or mask[position] != mask[start]:
            yield bool(mask[start]), ids[start:position]
            start = position


def extra_message_keys(prompt: Any) -> frozenset[str]:
    """The keys of the prompt's messages that `prompt_chat_messages` leaves out (set ones only)."""
    if isinstance(prompt, str):
        return frozenset()
    return frozenset(
        key for message in prompt or [] for key, value in message.items() if key not in ("role", "content") and value
    )


def prompt_chat_messages(prompt: Any, keep_parts: bool = False) -> list[dict[str, Any]]:
    """The prompt's messages as {"role", "content"} strings (other keys are not exported: the
    export's summary names them, `extra_message_keys`); with `keep_parts`, a content list of
    text and image parts is kept as it is stored (an image part is `{"type": "image"}`)."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    messages: list[dict[str, Any]] = []
    for message in prompt or []:
        content = message.get("content")
        if keep_parts and isinstance(content, list) and all(isinstance(part, dict) for part in content):
            messages.append({"role": str(message.get("role")), "content": content})
            continue
        if not isinstance(content, str):
            raise GenrunError(
                f"a prompt message's content is {type(content).__name__}, not text (multimodal prompts cannot be exported): {json.dumps(message, default=str)[:200]}"
            )
        messages.append({"role": str(message.get("role")), "content": content})
    return messages


def prompt_of(record: Any) -> Any:
    """A trajectory record's prompt messages: verl's RLHFDataset hands the agent loop them as raw_prompt."""
    fields = record.input_fields
    prompt = fields.get("raw_prompt", record.extra_fields.get("raw_prompt"))
    if prompt is None:
        raise GenrunError(
            f"trajectory {record.index}:{record.rollout_n} has no raw_prompt (the chat messages verl gives the agent loop); it cannot be exported as messages"
        )
    return prompt
