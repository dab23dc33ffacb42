"""Issue 43 item 10: every verl key that changes what verl generates either acts in genrun or is
refused. `reward_model.enable=true` was accepted and ignored (no model scores, no word), and a
dataset with images failed inside its shard after every retry with `AssertionError: processor is
needed`. config/verl_keys.py places every key; these tests hold it to the installed verl, to
docs/configuration.md, and to what load_config and preflight do with a key a user sets."""

from __future__ import annotations

import dataclasses
import json
import re

import hydra.utils
import pyarrow.parquet as pq
import pytest
from omegaconf import DictConfig, OmegaConf

from generation_core.config.loading import ADDED_DATA_KEYS, VERL_BASE_CONFIG, default_config, load_config
from generation_core.config.validation import verl_key_values
from generation_core.config.verl_keys import HONOURED, IRRELEVANT, REFUSED, SECTIONS, VERL_KEYS, engines_of, placement
from generation_core.errors import GenrunError
from tests.conftest import REPO, chat_rows, write_parquet

pytestmark = pytest.mark.timeout(120)


def _dataclass_fields(cfg: DictConfig) -> set[str]:
    """Keys verl's dataclasses take with `+` under SECTIONS (a field the generated YAML leaves out)."""
    keys: set[str] = set()

    def walk(node: DictConfig, prefix: str) -> None:
        target = node.get("_target_")
        if isinstance(target, str):
            cls = hydra.utils.get_class(target)
            if dataclasses.is_dataclass(cls):
                keys.update(f"{prefix}.{field.name}" for field in dataclasses.fields(cls) if field.name not in node)
        for name in node.keys():
            child = node._get_node(name)
            if isinstance(child, DictConfig) and not child._is_none() and not child._is_interpolation():
                walk(child, f"{prefix}.{name}")

    for section in SECTIONS:
        node = OmegaConf.select(cfg, section)
        if isinstance(node, DictConfig):
            walk(node, section)
    return keys


@pytest.fixture(scope="module")
def verl_tree() -> DictConfig:
    return OmegaConf.load(VERL_BASE_CONFIG)


@pytest.fixture(scope="module")
def genrun_tree() -> DictConfig:
    return default_config()


def test_every_key_of_verls_generation_sections_is_placed(verl_tree, genrun_tree):
    """Issue 43 item 10: a key of the installed verl's ppo_trainer config under data, the rollout,
    reward, reward_model or custom_reward_function (and each field its dataclasses take with +)
    that the table does not place fails here: an upgrade of verl must decide each new key."""
    keys = (
        set(verl_key_values(verl_tree))
        | set(verl_key_values(genrun_tree))
        | _dataclass_fields(genrun_tree)
        | set(ADDED_DATA_KEYS)
    )
    assert len(keys) > 250
    assert sorted(key for key in keys if placement(key) is None) == []
    # The two examples, placed as refused.
    assert placement("reward_model.enable")[0] == placement("reward.reward_model.enable")[0] == REFUSED
    assert placement("data.image_key")[0] == REFUSED


def test_every_entry_of_the_table_places_a_key_that_exists(genrun_tree):
    """No stale rows: each key names a key of the tree, a dataclass field or a free-form mapping
    genrun reads; each pattern places at least one key; statuses are the four kinds."""
    keys = set(verl_key_values(genrun_tree)) | _dataclass_fields(genrun_tree) | set(ADDED_DATA_KEYS)
    free_form = {
        "actor_rollout_ref.rollout.custom",
        "reward.custom_reward_function.reward_kwargs",
        "custom_reward_function.reward_kwargs",
    }
    for key, (status, reason) in VERL_KEYS.items():
        assert status in (HONOURED, REFUSED, IRRELEVANT) or engines_of(status), key
        assert reason and "\n" not in reason, key
        if "*" in key:
            assert any(re.fullmatch(re.escape(key).replace(r"\*", ".*"), known) for known in keys), (
                f"{key} places nothing"
            )
        else:
            assert key in keys or key in free_form, f"{key} is no key of verl's config"


def test_the_configuration_page_shows_the_table_of_the_code():
    """docs/configuration.md's verl-keys table is VERL_KEYS row for row (`+` marks a key the
    defaults do not hold)."""
    page = (REPO / "docs" / "configuration.md").read_text()
    section = page[page.index("## verl keys: honoured, refused or irrelevant") :]
    rows = re.findall(r"^\| `\+?([^`]+)` \| ([^|]+?) \| (.+) \|$", section, flags=re.MULTILINE)
    assert {key: (status, reason) for key, status, reason in rows} == VERL_KEYS
    assert len(rows) == len(VERL_KEYS)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["reward_model.enable=true"],
            r"^reward_model.enable=True: verl's older reward section: verl's reward model served as rollout replicas "
            r".*score with reward.custom_reward_function",
        ),
        (
            ["reward.reward_model.enable=true"],
            r"^reward.reward_model.enable=True: verl's reward model .* is not supported; "
            r"score with reward.custom_reward_function",
        ),
        (["reward_model.model.path=/models/rm"], r"^reward_model.model.path='/models/rm': verl's older reward section"),
        (
            ["reward.reward_manager.name=dapo"],
            r"^reward.reward_manager.name='dapo': genrun scores each trajectory as verl's naive reward manager does",
        ),
        (["data.image_key=pictures"], r"^data.image_key='pictures': .* not supported yet"),
        (
            ["actor_rollout_ref.rollout.do_sample=false"],
            r"^actor_rollout_ref.rollout.do_sample=False: .* set actor_rollout_ref.rollout.temperature=0",
        ),
        (["data.shuffle=true"], r"^data.shuffle=True: genrun generates every row"),
        (
            ["+actor_rollout_ref.rollout.repetition_penalty=1.1"],
            r"^actor_rollout_ref.rollout.repetition_penalty=1.1: every request carries repetition_penalty 1.0",
        ),
        (["actor_rollout_ref.rollout.nnodes=2"], r"^actor_rollout_ref.rollout.nnodes=2: set trainer.nnodes"),
        (["~reward.sandbox_fusion.url"], r"^~reward.sandbox_fusion.url: genrun does not call verl's code sandbox"),
        # Read only by verl's SGLang/vLLM servers: with another engine, refused naming both.
        (
            ["actor_rollout_ref.rollout.dtype=float16"],
            r"^actor_rollout_ref.rollout.dtype='float16' acts only with actor_rollout_ref.rollout.name=sglang or vllm, "
            r"not hf \(.*engine_kwargs.hf.dtype\); remove it",
        ),
        (
            [
                "actor_rollout_ref.rollout.name=instant",
                "+actor_rollout_ref.rollout.engine_kwargs.sglang.attention_backend=fa3",
            ],
            r"engine_kwargs.sglang=\{'attention_backend': 'fa3'\} acts only with "
            r"actor_rollout_ref.rollout.name=sglang, not instant",
        ),
    ],
)
def test_a_verl_key_genrun_would_not_act_on_is_refused_in_one_line(overrides, message):
    """Issue 43 item 10: `reward_model.enable=true` (and every key placed as refused, or read only
    by other engines) was accepted and ignored; now one line names the key and what to do."""
    with pytest.raises(GenrunError) as refused:
        load_config(overrides)
    assert re.search(message, str(refused.value)) and "\n" not in str(refused.value), str(refused.value)


def test_keys_set_to_their_default_honoured_or_irrelevant_are_accepted():
    """Only a key the user changed is judged: its default (or a value an interpolation follows)
    passes, as do honoured keys and keys that change nothing generated."""
    cfg = load_config(
        [
            "reward_model.enable=null",
            "data.shuffle=false",
            "actor_rollout_ref.rollout.do_sample=true",
            "trainer.nnodes=1",
            "data.max_prompt_length=100",
            "actor_rollout_ref.rollout.temperature=0.5",
            "data.val_files=/elsewhere.parquet",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size=8",
            "+actor_rollout_ref.rollout.enable_sleep_mode=false",
            "custom_reward_function.path=/r.py",
        ]
    )
    assert cfg.actor_rollout_ref.rollout.prompt_length == 100, "an interpolated default follows its source unjudged"
    assert cfg.reward.custom_reward_function.path == "/r.py"
    sglang = load_config(
        [
            "actor_rollout_ref.rollout.name=sglang",
            "actor_rollout_ref.rollout.dtype=float16",
            "+actor_rollout_ref.rollout.engine_kwargs.sglang.attention_backend=fa3",
        ]
    )
    assert sglang.actor_rollout_ref.rollout.dtype == "float16"


def test_a_key_the_table_does_not_place_is_refused_when_set(monkeypatch):
    """A key a newer verl adds (placed by nothing) is refused rather than silently ignored."""
    import generation_core.config.validation as validation

    monkeypatch.setattr(validation, "placement", lambda key: None if key == "data.prompt_key" else placement(key))
    with pytest.raises(
        GenrunError, match=r"^data.prompt_key='question': genrun does not know whether this verl key would act"
    ):
        load_config(["data.prompt_key=question"])
    load_config([])  # untouched keys are not judged


def _media_file(path, images):
    rows = chat_rows(len(images))
    for row, image in zip(rows, images, strict=True):
        row["images"] = image
    return write_parquet(path, rows)


def test_a_dataset_with_images_is_refused_at_preflight_naming_file_row_and_column(tmp_path, model_dir, capsys):
    """Issue 43 item 10: a dataset whose rows carry images ran until its shard failed after every
    retry with `AssertionError: processor is needed`; now the CLI refuses it in one line, exit 2,
    before Prefect, Ray or any model starts, and writes nothing."""
    from flows.cli import main

    images = _media_file(tmp_path / "mm.parquet", [[], None, [{"bytes": b"\x89PNG", "path": "a.png"}]])
    out = tmp_path / "out"
    code = main(
        [f"data.train_files={images}", f"trainer.default_local_dir={out}", "actor_rollout_ref.rollout.name=instant"]
    )
    err = capsys.readouterr().err
    assert code == 2, err
    # The refusal is the last line (the run's first line comes before it).
    # Images need a vision-language model (docs/multimodal.md); the bundled model is a text-only one.
    assert err.strip().splitlines()[-1] == (
        f"genrun: error: data file {images} row 2: column 'images' (data.image_key) holds images, and the model "
        f"{model_dir} is a text-only llama model: images need a vision-language model (e.g. Qwen2.5-VL); set "
        "actor_rollout_ref.model.path to one, or drop the column"
    )
    assert not out.exists()


def test_media_columns_that_are_empty_pass_and_json_files_are_checked_too(tmp_path):
    """An `images` column empty or null in the first rows is a text dataset; a JSON file's
    `videos` are read as a Parquet file's are."""
    from generation_core.inputs.dataset_files import inspect_dataset

    empty = _media_file(tmp_path / "empty.parquet", [[], None, []])
    assert inspect_dataset(load_config([f"data.train_files={empty}"])).files.num_rows == 3
    rows = chat_rows(2)
    rows[1]["videos"] = ["clip.mp4"]
    jsonl = tmp_path / "v.jsonl"
    jsonl.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(GenrunError, match=r"v.jsonl row 1: column 'videos' \(data.video_key\) holds videos"):
        inspect_dataset(load_config([f"data.train_files={jsonl}"]))
    assert pq.read_table(empty).num_rows == 3
