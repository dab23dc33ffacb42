"""genrun's own config keys (`generation:`, engine_kwargs.{hf,remote,instant}) are each declared
once, as a settings field made by `checks.key` (default, rule, whether it shapes output, its doc):
load_config takes the defaults from there (genrun.yaml repeats none), the settings check their own
values as they are built, the fingerprint leaves out the keys that do not shape output, and
docs/configuration.md's tables are generated from them. The settings classes are the one owner of
the `generation:` section: nothing outside config/ reads it, and nothing they derive is written
back into the config."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
from omegaconf import OmegaConf

import generation_core
from generation_core.config.checks import declared, defaults_of, integer, key, key_table
from generation_core.config.engine_kwargs import HfEngineKwargs, InstantEngineKwargs, check_hf_device, hf_device
from generation_core.config.loading import load_config
from generation_core.config.settings import DECLARED, GenerationSettings
from generation_core.errors import GenrunError

pytestmark = pytest.mark.timeout(120)

GENRUN_YAML = Path(generation_core.__file__).parent / "config" / "genrun.yaml"


def test_genrun_yaml_repeats_no_declared_key_and_the_config_holds_every_declared_default():
    """Issue 53 item 1: genrun.yaml carried every generation: and engine_kwargs.{hf,remote,instant}
    key again beside the field's default (a test kept the two equal); now load_config merges the
    declarations' defaults, so a new key is written once."""
    yaml_tree = OmegaConf.load(GENRUN_YAML)
    assert sorted(DECLARED) == [
        "actor_rollout_ref.rollout.engine_kwargs.hf",
        "actor_rollout_ref.rollout.engine_kwargs.instant",
        "actor_rollout_ref.rollout.engine_kwargs.remote",
        "generation",
    ]
    assert [section for section in DECLARED if OmegaConf.select(yaml_tree, section) is not None] == []
    cfg = load_config([])
    for section, cls in DECLARED.items():
        loaded = dict(OmegaConf.to_container(OmegaConf.select(cfg, section)))
        if section.endswith(".hf"):
            assert loaded.pop("device") == "cpu", "load_config decides the device (trainer.device)"
            loaded["device"] = None
        assert loaded == defaults_of(cls), section
    assert len(declared(GenerationSettings)) == 33


def test_a_key_declared_without_the_declaration_is_refused():
    @dataclasses.dataclass(frozen=True)
    class Undeclared:
        plain: int = 1

    with pytest.raises(TypeError, match="Undeclared.plain is not declared with config.checks.key"):
        declared(Undeclared)


def test_a_key_declared_in_one_place_is_validated_fingerprinted_and_documented(monkeypatch):
    """Issue 53 item 1: one declaration is all a new key needs: load_config knows it with its
    default, a bad value is refused in one line, the fingerprint takes it in (or leaves it out,
    for an operational key, so a resumed run may change it) and the docs table lists it."""
    from generation_core.preflight.fingerprint import fingerprint, operational_keys
    from tests.test_docs import with_key_tables

    rule = (integer(1), "must be an integer >= 1")

    @dataclasses.dataclass(frozen=True)
    class WithNewKeys(GenerationSettings):
        output_key: int = key(3, rule, True, "a key of this test that shapes output")
        operational_key: int = key(3, rule, False, "a key of this test that does not")

    monkeypatch.setitem(DECLARED, "generation", WithNewKeys)
    defaults = load_config([])
    assert (defaults.generation.output_key, defaults.generation.operational_key) == (3, 3)
    with pytest.raises(GenrunError) as refused:
        load_config(["generation.operational_key=0"])
    assert str(refused.value) == "invalid generation.operational_key=0: must be an integer >= 1"
    assert "generation.operational_key" in operational_keys() and "generation.output_key" not in operational_keys()
    before = fingerprint(defaults, "d", {})
    assert fingerprint(load_config(["generation.operational_key=5"]), "d", {}) == before, "a resume may change it"
    assert fingerprint(load_config(["generation.output_key=5"]), "d", {}) != before, "another run"
    table = key_table("generation", WithNewKeys)
    assert "| `generation.output_key` | 3 | output | a key of this test that shapes output |" in table
    assert "| `generation.operational_key` | 3 | operational | a key of this test that does not |" in table
    page = (Path(generation_core.__file__).parent.parent / "docs" / "configuration.md").read_text()
    assert "generation.output_key" in with_key_tables(page) and "generation.output_key" not in page


def test_the_stall_alarms_default_is_named_for_what_it_decides():
    """Review 2026-11-28 §6.3: a search-and-replace had named it `default_stallnumber`, while the
    field's doc named `default_stall_seconds`."""
    from generation_core.config.settings import default_stall_seconds

    assert default_stall_seconds(856) == 214 and default_stall_seconds(10) == 120


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
        (lambda: GenerationSettings(final_merge="yes"), "invalid generation.final_merge='yes': must be true or false"),
        (
            lambda: InstantEngineKwargs(delay_seconds=-1),
            "invalid actor_rollout_ref.rollout.engine_kwargs.instant.delay_seconds=-1: must be a number of seconds >= 0",
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
