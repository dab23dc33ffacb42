"""A task's default data_source (issue 51 item 6): the loader's name (`json`) told nothing about the
rows and matched none of verl's scorers; now the data file's stem for a builder `datasets` ships,
the hub dataset or folder otherwise. No dataset is read."""

from __future__ import annotations

import pytest

from generation_core.inputs.tasks import TaskConfig

pytestmark = pytest.mark.timeout(60)

TEMPLATE = {"prompt_template": "Q: {question}"}


@pytest.mark.parametrize(
    ("loading", "expected"),
    [
        ({"path": "json", "data_files": "/data/in/gsm8k.jsonl", "split": "train"}, "gsm8k"),
        ({"path": "parquet", "data_files": {"train": ["s3://bucket/math/train-00000.parquet"]}}, "train-00000"),
        ({"path": "csv", "data_files": "/data/questions/*.csv"}, "questions"),
        ({"path": "openai/gsm8k", "name": "main"}, "openai/gsm8k"),
    ],
)
def test_a_tasks_default_data_source_names_its_data_not_its_loader(loading, expected):
    assert TaskConfig.of({"loading_params": loading, "prompt_format": TEMPLATE}, "data.train_tasks[0]").data_source == (
        expected
    )


def test_a_data_source_the_task_names_is_kept():
    task = {"loading_params": {"path": "json", "data_files": "/d/a.jsonl"}, "prompt_format": TEMPLATE}
    assert TaskConfig.of({**task, "data_source": "openai/gsm8k"}, "data.train_tasks[0]").data_source == "openai/gsm8k"
