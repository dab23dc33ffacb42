"""The simulated engine as a verl replica: its settings from the rollout config and
`engine_kwargs.simulated`, checked here (genrun's config does not know them)."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping
from typing import Any

from bench.sim.engine import ROLLOUT_FIELDS, SimulatedEngine, SimulatedSettings
from generation_core.engines.base import Engine
from generation_core.engines.replicas import EngineReplica, model_tokens
from generation_core.errors import GenrunError

KWARGS_KEY = "actor_rollout_ref.rollout.engine_kwargs.simulated"
KWARGS_FIELDS = {f.name: f for f in dataclasses.fields(SimulatedSettings) if f.name not in ROLLOUT_FIELDS}


def simulated_kwargs(engine_kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """`engine_kwargs.simulated` as SimulatedSettings' keyword arguments, or a GenrunError that
    names the key (an unknown one, a value of the wrong kind or out of range)."""
    given = dict((engine_kwargs or {}).get("simulated") or {})
    unknown = sorted(set(given) - set(KWARGS_FIELDS))
    if unknown:
        raise GenrunError(f"unknown key {KWARGS_KEY}.{unknown[0]}; the simulator's keys: {', '.join(KWARGS_FIELDS)}")
    for key, value in given.items():
        number = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
        if not number or value < 0 or (KWARGS_FIELDS[key].type == "int" and value != int(value)):
            kind = "an integer" if KWARGS_FIELDS[key].type == "int" else "a number"
            raise GenrunError(f"invalid {KWARGS_KEY}.{key}={value!r}: must be {kind} >= 0")
    share = given.get("response_tokens_prompt_share", 0.0)
    if share > 1:
        raise GenrunError(
            f"invalid {KWARGS_KEY}.response_tokens_prompt_share={share!r}: must be a fraction between 0 "
            "(each sample's length its own) and 1 (the prompt decides it)"
        )
    return given


class SimulatedReplica(EngineReplica):
    engine_name = "simulated"

    def build_engine(self) -> Callable[[], Engine]:
        kwargs = simulated_kwargs(self.config.engine_kwargs)
        eos, vocab_size = model_tokens(self.model_config.path)
        seed = int(kwargs.pop("seed", SimulatedSettings.seed))
        settings = SimulatedSettings(
            prompt_length=self.config.prompt_length,
            response_length=self.config.response_length,
            eos_token_id=eos,
            max_num_seqs=int(self.config.max_num_seqs),
            vocab_size=vocab_size,
            # Each replica its own length stream: replicas of one run do not draw the same lengths.
            seed=seed + self.replica_rank,
            **kwargs,
        )
        return functools.partial(SimulatedEngine, settings)
