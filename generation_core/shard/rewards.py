"""The optional user reward function, scored per trajectory off the event loop.

verl's convention: `reward.custom_reward_function.path` is a Python file and `.name` a function
in it (default `compute_score`), called as `compute_score(data_source=..., solution_str=...,
ground_truth=..., extra_info=...)`, returning a float or a dict with a "score" key (its other
keys become reward_extra_info and columns of the merged DataProto). We call it exactly as verl's
naive reward manager does. Synchronous functions run in a thread pool of
`generation.reward_workers`, so a slow scorer never stalls the requests of other samples;
`async def` functions are awaited.

Without a custom function, verl scores by `data_source` (`verl.utils.reward_score.
default_compute_score`: openai/gsm8k, the MATH sets, math_dapo/aime*, numina_*, geometry3k,
searchR1_*), and so does genrun: a sample whose data_source verl has a scorer for and whose row
has a ground truth is scored by it; other samples get no score (verl would stop there with
NotImplementedError). verl's code data sources (codecontests, apps, codeforces, taco) are left
unscored: without a sandbox verl's default runs the model's code on this machine; give your own
sandboxed scorer in reward.custom_reward_function for them. The scorer is verl's, so the run
fingerprint's verl version pins it.
"""

from __future__ import annotations

import asyncio
import inspect
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig

from generation_core.config.settings import GenerationSettings
from generation_core.errors import GenrunError
from generation_core.store.trajectory_record import score_or_none


class RewardFunctionError(RuntimeError):
    """The user's reward function raised or returned something that is not a score."""


@dataclass
class RewardResult:
    score: float | None
    """None when the function returned NaN: a NaN score is no score (trajectory_record.score_or_none)."""
    extra_info: dict[str, Any]


def load_reward_function(cfg: DictConfig) -> Callable | None:
    """verl's own loader (path, name, reward_kwargs), with a clear message when it fails."""
    from verl.trainer.ppo.reward import get_custom_reward_fn

    spec = cfg.reward.custom_reward_function
    if not spec.path:
        return None
    path = os.path.expanduser(spec.path)
    if not os.path.isfile(path):
        raise GenrunError(
            f"reward.custom_reward_function.path={spec.path!r} does not exist; give the path of a Python file"
        )
    try:
        return get_custom_reward_fn(cfg)
    except AttributeError:
        raise GenrunError(
            f"reward.custom_reward_function.path={spec.path!r} has no function {spec.name!r}; set reward.custom_reward_function.name"
        ) from None
    except Exception as exc:  # noqa: BLE001 - any error importing the user's file
        # verl wraps it in RuntimeError("Error loading module from ..."): the user's own error is
        # the one to show (a SyntaxError names its file and line).
        cause: BaseException = exc
        while cause.__cause__ is not None:
            cause = cause.__cause__
        reason = f"{type(cause).__name__}: {cause}".splitlines()[0]
        raise GenrunError(f"reward.custom_reward_function.path={spec.path!r} fails to import: {reason}") from None


# verl's default scorers that execute the model's answer as code (prime_code without a sandbox).
VERL_CODE_DATA_SOURCES = frozenset({"codecontests", "apps", "codeforces", "taco"})
NO_SCORE = RewardResult(None, {})


class RewardScorer:
    def __init__(self, function: Callable, tokenizer, workers: int, *, by_data_source: bool = False):
        self.function = function
        self.tokenizer = tokenizer
        # verl wraps the user's function in functools.partial over an async or a sync caller.
        self.is_async = inspect.iscoroutinefunction(getattr(function, "func", function))
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="reward")
        self.by_data_source = by_data_source
        """verl's default scorer: only data sources it implements are scored (the others learned
        from its NotImplementedError, once each)."""
        self.unscored_sources: set[Any] = set(VERL_CODE_DATA_SOURCES) if by_data_source else set()

    @classmethod
    def from_config(cls, cfg: DictConfig, tokenizer, settings: GenerationSettings | None = None) -> RewardScorer:
        """`settings`: the run's (RunPlan.settings); None: decided from `cfg`."""
        function = load_reward_function(cfg)
        workers = (settings if settings is not None else GenerationSettings.of(cfg)).reward_workers
        if function is not None:
            return cls(function, tokenizer, workers)
        from verl.utils.reward_score import default_compute_score

        return cls(default_compute_score, tokenizer, workers, by_data_source=True)

    async def score(
        self, response_ids: list[int], sample: dict[str, Any], num_turns: int, extra_fields: dict[str, Any]
    ) -> RewardResult:
        """Score one trajectory; `sample` is the dataset row's fields as the agent loop got them."""
        if self.by_data_source:
            source, truth = sample.get("data_source"), (sample.get("reward_model") or {}).get("ground_truth")
            if not isinstance(source, str) or source in self.unscored_sources or truth is None or truth == "":
                return NO_SCORE
            try:
                return await self._score(response_ids, sample, num_turns, extra_fields)
            except RewardFunctionError as error:
                if isinstance(error.__cause__, NotImplementedError):
                    self.unscored_sources.add(source)
                    return NO_SCORE
                raise
        return await self._score(response_ids, sample, num_turns, extra_fields)

    async def _score(
        self, response_ids: list[int], sample: dict[str, Any], num_turns: int, extra_fields: dict[str, Any]
    ) -> RewardResult:
        loop = asyncio.get_running_loop()
        solution = await loop.run_in_executor(
            self.pool, lambda: self.tokenizer.decode(response_ids, skip_special_tokens=True)
        )
        extra_info = dict(sample.get("extra_info") or {})
        extra_info["num_turns"] = num_turns
        extra_info["rollout_reward_scores"] = extra_fields.get("reward_scores", {})
        arguments = dict(
            data_source=sample.get("data_source"),
            solution_str=solution,
            ground_truth=(sample.get("reward_model") or {}).get("ground_truth"),
            extra_info=extra_info,
        )
        try:
            if self.is_async:
                result = await self.function(**arguments)
            else:
                result = await loop.run_in_executor(self.pool, lambda: self.function(**arguments))
        except Exception as exc:  # noqa: BLE001 - the user's code: recorded as this sample's failure
            raise RewardFunctionError(f"reward function raised {type(exc).__name__}: {exc}") from exc
        return _as_result(result)

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def _as_result(result: Any) -> RewardResult:
    # Same shapes as verl's naive reward manager: a dict with "score", or a bare number.
    if isinstance(result, dict):
        if "score" not in result:
            raise RewardFunctionError(f"reward function returned a dict without a 'score' key (keys: {sorted(result)})")
        score, extra_info = result["score"], dict(result)
    else:
        score, extra_info = result, {"acc": result}
    try:
        return RewardResult(score_or_none(score), extra_info)
    except (TypeError, ValueError):
        raise RewardFunctionError(f"reward function returned {score!r}, not a number") from None
