"""genrun.yaml is the reference a user reads, generation_core/config/settings.py and engine_kwargs.py
the defaults the code uses: every default written in both must be the same value, and every setting
the code reads must have its key in genrun.yaml, so the two can never disagree. The settings classes
are the one owner of the `generation:` section: nothing outside config/ reads it, they check their
own values, and nothing they derive is written back into the config."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
from omegaconf import OmegaConf

import generation_core
from generation_core.config.engine_kwargs import ENGINE_KWARGS, HfEngineKwargs, check_hf_device, hf_device
from generation_core.config.loading import load_config
from generation_core.config.settings import GenerationSettings
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


REPO = Path(generation_core.__file__).parent.parent


def _generation_reads(path: Path) -> list[str]:
    """Where `path` reads a config's `generation` section: `<...cfg|config>.generation`,
    `x["generation"]`, `x.get("generation")` (or any `generation.` key by name)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr == "generation":
            read = ast.unparse(node.value).endswith(("cfg", "config"))
        elif isinstance(node, ast.Subscript):
            read = isinstance(node.slice, ast.Constant) and node.slice.value == "generation"
        elif (
            isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("get", "select")
        ):
            keys = [arg.value for arg in node.args if isinstance(arg, ast.Constant) and isinstance(arg.value, str)]
            read = any(key == "generation" or key.startswith("generation.") for key in keys)
        else:
            continue
        if read:
            found.append(f"{path.relative_to(REPO)}:{node.lineno} {ast.unparse(node)}")
    return found


def test_only_config_reads_the_generation_section():
    """Issue 44 item 11 / review finding 3: 19 places outside config/ read `cfg.generation.*`
    (`.get("gpu_hour_price")` with its own default, `finish_run` three ways in 27 lines); every
    one now reads the settings (GenerationSettings.of, RunPlan.settings)."""
    outside = [
        path
        for root in ("generation_core", "flows", "tasks")
        for path in sorted((REPO / root).rglob("*.py"))
        if not path.is_relative_to(REPO / "generation_core" / "config")
    ]
    assert [read for path in outside for read in _generation_reads(path)] == []
    assert _generation_reads(REPO / "generation_core" / "config" / "settings.py"), "the scan finds the owner's read"


@pytest.mark.parametrize(
    "build, refusal",
    [
        (
            lambda: GenerationSettings(max_inflight=0),
            "invalid generation.max_inflight=0: must be null (twice actor_rollout_ref.rollout.max_num_seqs) "
            "or an integer >= 1",
        ),
        (lambda: GenerationSettings(retries=True), "invalid generation.retries=True: must be an integer >= 0"),
        (lambda: GenerationSettings(routing="random"), "invalid generation.routing='random': must be one of "),
        (
            lambda: GenerationSettings.of(
                {"generation": {"adaptive": True, "adaptive_k": 4}, "actor_rollout_ref": {"rollout": {"n": 4}}}
            ),
            "invalid generation.adaptive_k=4: must be an integer from 1 to actor_rollout_ref.rollout.n - 1 (n=4) "
            "with generation.adaptive=true",
        ),
        (
            lambda: HfEngineKwargs(prefix_cache_bytes=-1),
            "invalid actor_rollout_ref.rollout.engine_kwargs.hf.prefix_cache_bytes=-1: must be null",
        ),
    ],
)
def test_a_settings_class_refuses_its_own_bad_values(build, refusal):
    """Issue 44 item 11: the checks live in the dataclasses (validation.py checked the raw
    DictConfig apart from them and repeated a default): a bad value is refused, in one line, by
    whoever builds the settings."""
    with pytest.raises(GenrunError) as refused:
        build()
    assert str(refused.value).startswith(refusal) and "\n" not in str(refused.value)


def test_load_config_writes_nothing_derived_back_into_the_config():
    """Issue 44 item 11 / review finding 3: load_config wrote max_inflight, max_open_trajectories
    and the three deadlines back into the DictConfig; now every process decides them from the
    config as the user wrote it, the same way."""
    cfg = load_config(["actor_rollout_ref.rollout.max_num_seqs=8"])
    derived = ("max_inflight", "max_open_trajectories", "request_timeout", "sample_timeout_seconds", "stall_seconds")
    assert {key: cfg.generation[key] for key in derived} == dict.fromkeys(derived)
    settings = GenerationSettings.of(cfg)
    assert (settings.max_inflight, settings.max_open_trajectories, settings.request_timeout) == (16, 128, 600 + 2 * 128)
