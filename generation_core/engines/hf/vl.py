"""The transformers engine for vision-language models: one request at a time through `generate`.

verl's agent loop sends a VL model's turn as the prompt ids its processor rendered (each image's
`<|image_pad|>` run already expanded) and the images themselves (`image_data`: the resized PIL
images). This engine computes their `pixel_values` and `image_grid_thw` with the model's image
processor and calls the model's own `generate` with them, one request after another in one
thread. It is the plainer path, chosen over the continuous-batching engine (engine.py): that
engine's packed steps, prefix cache and KV slots assume 1-D positions and text-only inputs, while
Qwen2-VL-class models need mrope positions from `get_rope_index` and the vision tower's
embeddings merged into the prompt, which transformers' `generate` does. It serves tests and small
CPU runs; a VL model at scale runs on sglang or vllm (docs/multimodal.md).

Sampling follows the request (temperature, top_p, top_k, max_tokens, ignore_eos, logprobs; a
request's seed seeds torch's generator for its draw), with the response budget every engine uses.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import torch

from generation_core.engines.base import STOP_EOS, STOP_LENGTH, EngineOutput, SamplingParams, response_budget
from generation_core.inputs.vl_processor import model_type, pil_image_processor

EngineSettings = Any
"""engine.py's EngineSettings (model_path, prompt_length, response_length, num_threads, dtype,
device, trust_remote_code): engine.py builds this engine (engine_on_this_node), so this module
does not import it back."""


def is_vision_language(settings: EngineSettings) -> bool:
    """Whether the settings' model folder holds a vision-language model (its config has a vision part)."""
    return model_type(settings.model_path, settings.trust_remote_code)[1]


class VisionLanguageEngine:
    """The engine contract (engines/base.py) over a VL model's `generate`, one request at a time."""

    def __init__(self, settings: EngineSettings, eos_token_ids: list[int]):
        """`eos_token_ids`: the ids that end a response, by the transformers engine's rule."""
        from transformers import AutoModelForImageTextToText

        if settings.num_threads:
            torch.set_num_threads(settings.num_threads)
        self.settings = settings
        path = str(Path(settings.model_path).expanduser())
        self.model = AutoModelForImageTextToText.from_pretrained(
            path, dtype=getattr(torch, settings.dtype), trust_remote_code=settings.trust_remote_code
        ).to(settings.device)
        self.model.eval()
        # The image processor alone (the prompt ids come rendered): transformers' PIL one, no verl here.
        self.image_processor = pil_image_processor(path, model_type(path, settings.trust_remote_code)[0])
        self.eos_token_ids = list(eos_token_ids)
        self.name = f"transformers VL engine ({Path(path).name} on {settings.device})"
        self.stats: dict[str, Any] = {"requests": 0, "generated_tokens": 0, "prefill_tokens": 0}
        self._lock = threading.Lock()

    async def generate(
        self,
        request_id: str,
        *,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        image_data: list[Any] | None = None,
        video_data: Any = None,
        **_unused: Any,
    ) -> EngineOutput:
        params = SamplingParams.from_request(sampling_params)
        if video_data:
            raise ValueError(f"request {request_id}: {self.name} takes images, not videos")
        budget = response_budget(self.settings.prompt_length, self.settings.response_length, len(prompt_ids), None)
        budget = min(budget, params.max_tokens) if params.max_tokens is not None else budget
        if budget <= 0:
            return EngineOutput(token_ids=[], log_probs=[] if params.logprobs else None, stop_reason=STOP_LENGTH)
        return await asyncio.to_thread(self._generate, [int(t) for t in prompt_ids], params, budget, image_data)

    def _generate(self, prompt_ids: list[int], params: SamplingParams, budget: int, images: list[Any] | None):
        device = self.settings.device
        inputs: dict[str, Any] = {"input_ids": torch.tensor([prompt_ids], device=device)}
        inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
        if images:
            vision = self.image_processor(images=images, return_tensors="pt")
            inputs["pixel_values"] = vision["pixel_values"].to(device, self.model.dtype)
            inputs["image_grid_thw"] = vision["image_grid_thw"].to(device)
        sampling: dict[str, Any] = {"do_sample": False}
        if not params.greedy:
            sampling = {"do_sample": True, "temperature": params.temperature, "top_p": params.top_p}
            sampling["top_k"] = params.top_k if params.top_k > 0 else None
        with self._lock, torch.inference_mode():
            if params.seed is not None:
                torch.manual_seed(params.seed)
            out = self.model.generate(
                **inputs,
                **sampling,
                max_new_tokens=budget,
                min_new_tokens=budget if params.ignore_eos else None,
                eos_token_id=self.eos_token_ids,
                pad_token_id=self.eos_token_ids[0],
                output_logits=params.logprobs,
                return_dict_in_generate=True,
            )
        tokens = out.sequences[0, len(prompt_ids) :].tolist()
        stop_reason = STOP_EOS if tokens and tokens[-1] in self.eos_token_ids and not params.ignore_eos else STOP_LENGTH
        log_probs = None
        if params.logprobs:
            # Raw model log-probabilities (before temperature/top-k/top-p), as the text engine gives them.
            log_probs = [
                float(torch.log_softmax(logits[0].float(), dim=-1)[token])
                for logits, token in zip(out.logits, tokens, strict=True)
            ]
        self.stats["requests"] += 1
        self.stats["generated_tokens"] += len(tokens)
        self.stats["prefill_tokens"] += len(prompt_ids)
        return EngineOutput(token_ids=tokens, log_probs=log_probs, stop_reason=stop_reason, num_preempted=0)

    def shutdown(self) -> None:
        return None
