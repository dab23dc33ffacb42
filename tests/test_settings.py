"""genrun.yaml is the reference a user reads, generation_core/config/settings.py the defaults the code
uses: every default written in both must be the same value, and every setting the code reads must
have its key in genrun.yaml, so the two can never disagree."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from omegaconf import OmegaConf

import generation_core
from generation_core.config.settings import (
    ENGINE_KWARGS,
    GenerationSettings,
    HfEngineKwargs,
    check_hf_device,
    hf_device,
)
from generation_core.errors import GenrunError

pytestmark = pytest.mark.timeout(120)

GENRUN_YAML = Path(generation_core.__file__).parent / "config" / "genrun.yaml"

SECTIONS = {
    "generation": GenerationSettings,
    **{f"actor_rollout_ref.rollout.engine_kwargs.{engine}": cls for engine, cls in ENGINE_KWARGS.items()},
}


def _default(field: dataclasses.Field):
    return field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default


@pytest.mark.parametrize("section", sorted(SECTIONS))
def test_every_default_in_genrun_yaml_is_the_settings_default(section):
    yaml_section = OmegaConf.to_container(OmegaConf.select(OmegaConf.load(GENRUN_YAML), section))
    assert isinstance(yaml_section, dict)
    settings_fields = {field.name: field for field in dataclasses.fields(SECTIONS[section])}
    assert sorted(yaml_section) == sorted(settings_fields), (
        f"{section}: genrun.yaml's keys and {SECTIONS[section].__name__}'s fields differ"
    )
    disagree = {
        key: (value, _default(settings_fields[key]))
        for key, value in yaml_section.items()
        if value != _default(settings_fields[key])
    }
    assert disagree == {}, f"{section}: genrun.yaml vs settings.py (key: (yaml, code))"


def test_a_run_record_written_before_a_key_existed_reads_with_the_default():
    """run.json of an older genrun lacks keys added since; `of` reads what is there."""
    settings = GenerationSettings.of(
        {"generation": {"lease_seconds": 30, "no_longer_a_key": 1}, "actor_rollout_ref": {"rollout": {}}}
    )
    assert settings.lease_seconds == 30
    assert settings.merge_max_file_bytes == GenerationSettings.merge_max_file_bytes
    assert settings.max_inflight is None and settings.request_timeout is None, "nothing to derive them from"


def test_derived_defaults_are_computed_from_the_rollout_config():
    rollout = {"max_num_seqs": 8, "response_length": 100, "multi_turn": {"enable": True, "max_assistant_turns": 3}}
    settings = GenerationSettings.of({"generation": {"request_retries": 1}, "actor_rollout_ref": {"rollout": rollout}})
    assert settings.max_inflight == settings.inflight_limit == 16
    assert settings.request_timeout == 600 + 2 * 100
    assert settings.sample_timeout_seconds == 3 * (1 + 2) * 800
    assert settings.systematic_failure_margin == 32, "twice the samples in flight"
    chosen = GenerationSettings.of(
        {"generation": {"max_inflight": 5, "request_timeout": 10}, "actor_rollout_ref": {"rollout": rollout}}
    )
    assert (chosen.max_inflight, chosen.request_timeout, chosen.sample_timeout_seconds) == (5, 10, 3 * 5 * 10)


def test_the_hf_device_is_decided_by_one_function():
    assert hf_device(None, None) == "cpu"
    assert hf_device(None, "cuda") == "cuda"
    assert hf_device("cpu", "cuda") == "cpu", "engine_kwargs.hf.device wins over trainer.device"
    assert check_hf_device("cuda:1") == "cuda:1"
    with pytest.raises(GenrunError, match="hf.device='npu'"):
        check_hf_device("npu")
    assert HfEngineKwargs().dtype_on("cuda") == "bfloat16" and HfEngineKwargs().dtype_on("cpu") == "float32"
    assert HfEngineKwargs(dtype="float16").dtype_on("cpu") == "float16"
    assert HfEngineKwargs.of({"hf": None}) == HfEngineKwargs()
