import pytest
from omegaconf import OmegaConf

from generation_core.config.loading import finalize_run_location, load_config
from generation_core.config.settings import GenerationSettings, default_request_timeout, default_sample_timeout
from generation_core.errors import GenrunError
from generation_core.preflight.fingerprint import OPERATIONAL_KEYS, fingerprint


def _settings(overrides: list[str]) -> GenerationSettings:
    return GenerationSettings.of(load_config(overrides))


def test_defaults_are_the_bundled_cpu_run():
    cfg = load_config([])
    assert cfg.actor_rollout_ref.rollout.name == "hf"
    assert cfg.actor_rollout_ref.model.path.endswith("SmolLM2-135M-Instruct")
    assert cfg.data.train_files.endswith("generation_core/config/demo_prompts.parquet")
    # verl's interpolation: rollout lengths follow data lengths.
    assert cfg.actor_rollout_ref.rollout.prompt_length == cfg.data.max_prompt_length
    assert cfg.actor_rollout_ref.rollout.response_length == cfg.data.max_response_length


def test_overrides_use_hydra_syntax():
    cfg = load_config(
        [
            "generation.num_shards=3",
            "trainer.logger=[console,wandb]",
            "storage.options.endpoint_url=http://127.0.0.1:9000",
            "+reward.custom_reward_function.reward_kwargs.judge=small",
        ]
    )
    assert cfg.generation.num_shards == 3
    assert list(cfg.trainer.logger) == ["console", "wandb"]
    assert cfg.storage.options.endpoint_url == "http://127.0.0.1:9000"
    assert cfg.reward.custom_reward_function.reward_kwargs.judge == "small"


@pytest.mark.parametrize(
    "override, closest",
    [
        ("+generation.num_shard=4", "'generation.num_shards'"),
        ("+train_tasks=[a.parquet,b.parquet]", "'data.train_tasks'"),
        # Newcomer 2026-11-28 item 6: not "did you mean 'generation'?" (nor a key of another section).
        ("+generation.note=hello", None),
        (
            "+actor_rollout_ref.rollout.engine_kwargs.hf.num_thread=2",
            "'actor_rollout_ref.rollout.engine_kwargs.hf.num_threads'",
        ),
    ],
)
def test_a_key_added_where_nothing_reads_it_is_refused_naming_the_closest_key(override, closest):
    """`+generation.num_shard=4` ran one shard and `+train_tasks=[...]` the bundled prompts, exit 0."""
    with pytest.raises(GenrunError, match="no such config key, and nothing would read it") as refused:
        load_config([override])
    assert "\n" not in str(refused.value)
    assert closest in str(refused.value) if closest else "did you mean" not in str(refused.value), refused.value


def test_keys_added_in_free_form_sections_are_accepted():
    """What another library, the user's reward function or a custom engine reads (each `+` key
    the docs, examples and tests use among them)."""
    added = {
        "+storage.options.client_kwargs.region_name=eu-west-1": "storage.options.client_kwargs.region_name",
        "+data.storage_options.endpoint_url=http://127.0.0.1:9000": "data.storage_options.endpoint_url",
        "+ray_kwargs.ray_init.runtime_env.env_vars.HF_HOME=/tmp/hf": "ray_kwargs.ray_init.runtime_env.env_vars.HF_HOME",
        "+reward.custom_reward_function.reward_kwargs.judge=small": "reward.custom_reward_function.reward_kwargs.judge",
        "+actor_rollout_ref.rollout.engine_kwargs.my_engine.depth=2": "actor_rollout_ref.rollout.engine_kwargs.my_engine.depth",
        "+actor_rollout_ref.rollout.custom.critique_turns=2": "actor_rollout_ref.rollout.custom.critique_turns",
        "+data.apply_chat_template_kwargs.enable_thinking=false": "data.apply_chat_template_kwargs.enable_thinking",
        "+actor_rollout_ref.rollout.enable_sleep_mode=false": "actor_rollout_ref.rollout.enable_sleep_mode",
        "+data.cache_dir=/tmp/verl": "data.cache_dir",
    }
    cfg = load_config([*added, "+generation.num_shards=2"])
    for key in added.values():
        assert OmegaConf.select(cfg, key) is not None, key
    assert cfg.generation.num_shards == 2, "+ on a key that exists sets it"
    # verl's SGLang server's own options, with that engine (config/verl_keys.py: another engine refuses them).
    sglang = load_config(
        [
            "actor_rollout_ref.rollout.name=sglang",
            "+actor_rollout_ref.rollout.engine_kwargs.sglang.mem_fraction_static=0.8",
        ]
    )
    assert sglang.actor_rollout_ref.rollout.engine_kwargs.sglang.mem_fraction_static == 0.8
    # verl's older top-level reward section: its kwargs reach the function too.
    legacy = load_config(["custom_reward_function.path=/r.py", "+custom_reward_function.reward_kwargs.judge=small"])
    assert legacy.reward.custom_reward_function.reward_kwargs.judge == "small"


@pytest.mark.parametrize(
    "override, expected",
    [
        ("generation.max_inflght=3", "did you mean 'generation.max_inflight'"),
        ("actor_rollout_ref.rollout.temprature=0", "did you mean 'actor_rollout_ref.rollout.temperature'"),
        ("data.promt_key=x", "did you mean 'data.prompt_key'"),
    ],
)
def test_unknown_key_names_the_closest_valid_key(override, expected):
    with pytest.raises(GenrunError, match=expected):
        load_config([override])


@pytest.mark.parametrize(
    "override, expected",
    [
        # Newcomer 2026-11-28 item 6: "did you mean 'generation'?" named the section itself.
        ("+generation.foo=1", None),
        ("generation.foo=1", None),
        ("+generation.retry=1", "generation.retries"),
        ("+generation.num_shard=2", "generation.num_shards"),
        # A key of another section is still found by its name.
        ("data.num_shards=2", "generation.num_shards"),
    ],
)
def test_a_new_key_in_a_section_is_matched_against_that_sections_keys(override, expected):
    with pytest.raises(GenrunError) as refused:
        load_config([override])
    suggestion = str(refused.value).partition("; did you mean ")[2]
    assert suggestion.startswith(f"'{expected}'?") if expected else suggestion == "", str(refused.value)


@pytest.mark.parametrize(
    "override, shown",
    [
        # Audit 2026-11-28 #10: Hydra's reason quoted the secret ("no viable alternative at input '[sk-AUDIT5X'").
        ("actor_rollout_ref.rollout.engine_kwargs.remote.api_key=[sk-AUDIT5X", "remote.api_key"),
        ("actor_rollout_ref.rollout.engine_kwargs.remote.api_key={a: sk-AUDIT5X", "remote.api_key"),
        ("+storage.options.client_kwargs={aws_secret_access_key: sk-AUDIT5X", "storage.options.client_kwargs"),
        ("data.train_files=[https://user:sk-AUDIT5X@host/p.parquet", "data.train_files"),
    ],
)
def test_an_override_hydra_cannot_read_never_shows_a_secret(override, shown):
    with pytest.raises(GenrunError) as refused:
        load_config([override])
    message = str(refused.value)
    assert "AUDIT5X" not in message, message
    assert message.startswith(f"cannot parse override {override.partition('=')[0]}=<redacted> "), message
    assert shown in message


def test_an_override_hydra_cannot_read_is_named_with_hydras_reason():
    with pytest.raises(GenrunError) as refused:
        load_config(["generation.num_shards=2", "data.train_files=[a.parquet"])
    assert str(refused.value).startswith(
        "cannot parse override 'data.train_files=[a.parquet': no viable alternative at input '[a.parquet'; "
    ), refused.value


def test_the_engine_names_are_verls_replicas_genrun_runs_and_remote():
    """Audit 2026-11-28 #14/#15: one static list (config/layout.py) names the engines, checked as the
    config loads; it is what the engine stack boots, less verl's TensorRT-LLM, plus remote."""
    from generation_core.config.layout import NOT_GENRUN_ENGINES, REMOTE_ENGINE, engine_names
    from generation_core.engines import replicas
    from generation_core.verl_adapter import registered_engine_names

    assert set(replicas.GENRUN_ENGINES) <= set(engine_names())
    assert set(engine_names()) == (set(registered_engine_names()) - set(NOT_GENRUN_ENGINES)) | {REMOTE_ENGINE}
    with pytest.raises(GenrunError) as refused:
        load_config(["actor_rollout_ref.rollout.name=trtllm"])
    assert str(refused.value) == (
        "actor_rollout_ref.rollout.name='trtllm' is verl's TensorRT-LLM replica, which genrun does not run (it has "
        f"no TensorRT-LLM engine); known engines: {', '.join(engine_names())}"
    )


@pytest.mark.parametrize(
    "override, expected",
    [
        ("actor_rollout_ref.rollout.n=0", "rollout.n=0: must be an integer >= 1"),
        ("data.max_response_length=-5", "response_length=-5"),
        ("actor_rollout_ref.rollout.temperature=-1", "temperature=-1"),
        ("actor_rollout_ref.rollout.top_p=0", "top_p=0"),
        ("generation.num_shards=abc", "num_shards='abc'"),
        ("generation.pull_timeout=0", "pull_timeout=0"),
        ("novalue", "write key=value"),
    ],
)
def test_invalid_values_are_refused(override, expected):
    with pytest.raises(GenrunError, match=expected.replace("[", r"\[")):
        load_config([override])


def test_fingerprint_ignores_operational_keys_only():
    base = fingerprint(load_config([]), "data")
    assert (
        fingerprint(
            load_config(
                ["generation.max_inflight=7", "generation.save_batch_size=3", "generation.show_progress=false"]
            ),
            "data",
        )
        == base
    )
    assert fingerprint(load_config(["actor_rollout_ref.rollout.temperature=0.5"]), "data") != base
    assert fingerprint(load_config([]), "other data") != base
    assert "trainer.default_local_dir" in OPERATIONAL_KEYS


def test_default_output_folder_derives_from_the_fingerprint():
    cfg = load_config([])
    finalize_run_location(cfg, "abcdef0123456789")
    assert cfg.trainer.experiment_name == "gen-abcdef012345"
    assert cfg.trainer.default_local_dir == "outputs/genrun/gen-abcdef012345"
    explicit = load_config(["trainer.default_local_dir=/tmp/x", "trainer.experiment_name=mine"])
    finalize_run_location(explicit, "abcdef0123456789")
    assert explicit.trainer.default_local_dir == "/tmp/x"


def test_pass_through_mappings_accept_their_libraries_keys():
    cfg = load_config(
        [
            "ray_kwargs.ray_init.address=127.0.0.1:6379",
            "ray_kwargs.ray_init.include_dashboard=true",
            "storage.options.anon=false",
        ]
    )
    assert cfg.ray_kwargs.ray_init.address == "127.0.0.1:6379"
    assert cfg.ray_kwargs.ray_init.include_dashboard is True
    assert cfg.storage.options.anon is False


def test_unknown_tracking_backend_is_refused():
    with pytest.raises(GenrunError, match="trainer.logger"):
        load_config(["trainer.logger=[console,wandbb]"])


@pytest.mark.parametrize(
    "overrides, expected",
    [
        # What a deployment's `parameters: {overrides: ...}` in prefect.yaml can hold by mistake.
        (
            "data.train_files=x.parquet",
            r"overrides must be a list of 'key=value' strings, got str 'data.train_files=x.parquet'",
        ),
        ({"data.train_files": "x.parquet"}, r"overrides must be a list of 'key=value' strings, got dict"),
        (["generation.num_shards=2", 4], r"overrides\[1\] must be a 'key=value' string, got int 4"),
        (
            ["generation.num_shards=2", {"generation.num_shards": 4}],
            r"overrides\[1\] must be a 'key=value' string, got dict",
        ),
        ([True], r"overrides\[0\] must be a 'key=value' string, got bool"),
    ],
)
def test_overrides_that_are_not_a_list_of_strings_are_refused_with_the_fix(overrides, expected):
    with pytest.raises(GenrunError, match=expected) as refused:
        load_config(overrides)
    assert "in prefect.yaml write parameters: {overrides: ['data.train_files=" in str(refused.value)


def test_no_overrides_is_the_defaults():
    assert load_config(None) == load_config([])
    assert load_config(("generation.num_shards=3",)).generation.num_shards == 3


def test_a_length_set_under_data_is_named_as_set():
    with pytest.raises(GenrunError, match=r"invalid data.max_prompt_length=-1: must be an integer >= 1"):
        load_config(["data.max_prompt_length=-1"])


ENGINE = "actor_rollout_ref.rollout.engine_kwargs"


@pytest.mark.timeout(120)
def test_engine_settings_that_shape_the_output_are_in_the_fingerprint_and_the_others_are_not():
    base = fingerprint(load_config([]), "data")
    shaping = [
        f"{ENGINE}.instant.response_tokens=4",
        f"{ENGINE}.hf.dtype=bfloat16",
        f"{ENGINE}.hf.ignore_eos=true",
        f"{ENGINE}.hf.device=cuda",
        f"{ENGINE}.remote.model=m",
    ]
    assert [o for o in shaping if fingerprint(load_config([o]), "data") == base] == []
    sglang = "actor_rollout_ref.rollout.name=sglang"
    assert fingerprint(load_config([sglang, f"+{ENGINE}.sglang.attention_backend=fa3"]), "data") != fingerprint(
        load_config([sglang]), "data"
    )
    operational = [
        f"{ENGINE}.hf.num_threads=1",
        f"{ENGINE}.instant.delay_seconds=1.0",
        f"{ENGINE}.remote.base_urls=[http://h:1]",
        f"{ENGINE}.remote.api_key=k",
        f"{ENGINE}.remote.connect_timeout=1",
        f"{ENGINE}.remote.health_interval=1",
        f"{ENGINE}.remote.max_connections=1",
        "generation.request_timeout=5",
        "generation.stall_seconds=30",
        "trainer.logger=[console]",
        "actor_rollout_ref.rollout.agent.num_workers=3",
        "data.dataloader_num_workers=2",
    ]
    assert [o for o in operational if fingerprint(load_config([o]), "data") != base] == []
    # A file given by its digest enters by content: its path may change, its content may not.
    moved = load_config(["actor_rollout_ref.model.path=/elsewhere/model"])
    assert fingerprint(moved, "data", {"actor_rollout_ref.model.path": "m1"}) == fingerprint(
        load_config([]), "data", {"actor_rollout_ref.model.path": "m1"}
    )
    assert fingerprint(moved, "data", {"actor_rollout_ref.model.path": "m2"}) != fingerprint(
        moved, "data", {"actor_rollout_ref.model.path": "m1"}
    )


@pytest.mark.timeout(120)
def test_stall_seconds_defaults_to_a_quarter_of_the_request_timeout_and_at_least_two_minutes():
    assert _settings([]).stall_seconds == (600 + 2 * 128) / 4
    assert _settings(["generation.request_timeout=60"]).stall_seconds == 120
    assert _settings(["generation.stall_seconds=30"]).stall_seconds == 30
    with pytest.raises(GenrunError, match=r"generation.stall_seconds=0\b.*must be null"):
        load_config(["generation.stall_seconds=0"])


@pytest.mark.timeout(120)
def test_request_timeout_defaults_to_a_finite_value_from_the_response_budget():
    assert _settings([]).request_timeout == default_request_timeout(128) == 600 + 2 * 128
    assert _settings(["data.max_response_length=4096"]).request_timeout == 600 + 2 * 4096
    assert _settings(["generation.request_timeout=42"]).request_timeout == 42
    with pytest.raises(GenrunError, match="request_timeout=0"):
        load_config(["generation.request_timeout=0"])


@pytest.mark.timeout(120)
def test_max_inflight_defaults_to_twice_the_decode_batch():
    assert _settings([]).max_inflight == 2 * 64
    assert _settings(["actor_rollout_ref.rollout.max_num_seqs=8"]).max_inflight == 16
    assert _settings(["actor_rollout_ref.rollout.max_num_seqs=8", "generation.max_inflight=3"]).max_inflight == 3
    for bad in ("0", "true", "many"):
        with pytest.raises(GenrunError, match="generation.max_inflight=.*must be null"):
            load_config([f"generation.max_inflight={bad}"])


@pytest.mark.timeout(120)
def test_the_sample_deadline_defaults_to_every_turns_request_attempts_and_is_operational():
    """turns x (request_retries + 2) x request_timeout: every turn keeps all its request
    attempts, and one request_timeout more for its tools (the last turn's: the reward)."""
    defaults = load_config([])
    assert (
        GenerationSettings.of(defaults).sample_timeout_seconds == default_sample_timeout(1, 3, 856) == 1 * (3 + 2) * 856
    )
    turns = _settings(
        [
            "actor_rollout_ref.rollout.multi_turn.enable=true",
            "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=3",
            "generation.request_timeout=10",
        ]
    )
    assert turns.sample_timeout_seconds == 3 * 5 * 10
    unlimited = _settings(
        [
            "actor_rollout_ref.rollout.multi_turn.enable=true",
            "generation.request_retries=0",
            "generation.request_timeout=10",
        ]
    )
    assert unlimited.sample_timeout_seconds == 16 * 2 * 10, "no turn limit: a finite allowance of turns"
    assert _settings(["generation.sample_timeout_seconds=7.5"]).sample_timeout_seconds == 7.5
    for bad in ("0", "-1", "soon"):
        with pytest.raises(
            GenrunError,
            match=f"generation.sample_timeout_seconds='?{bad}'?: must be null .* or a number of seconds > 0",
        ):
            load_config([f"generation.sample_timeout_seconds={bad}"])
    assert fingerprint(load_config(["generation.sample_timeout_seconds=5"]), "data") == fingerprint(defaults, "data"), (
        "a resumed run may change it"
    )
