"""The docs name the tests that hold their promises (docs/reliability.md, the README): every
`tests/<file>.py::<test>` they name must exist, so renaming or deleting a test cannot leave a
promise without its holder unnoticed."""

from __future__ import annotations

import ast
import re

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.timeout(60)

TEST_REFERENCE = re.compile(r"(tests/[\w/]+\.py)::(\w+)")
DOCS = ["README.md", *(str(path.relative_to(REPO)) for path in sorted((REPO / "docs").glob("*.md")))]


def _test_names(path: str) -> set[str]:
    tree = ast.parse((REPO / path).read_text())
    return {node.name for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test_")}


@pytest.mark.parametrize("doc", DOCS)
def test_every_test_a_doc_names_exists(doc):
    references = TEST_REFERENCE.findall((REPO / doc).read_text())
    missing = [f"{path}::{name}" for path, name in references if not (REPO / path).exists() or name not in _test_names(path)]
    assert not missing, f"{doc} names tests that do not exist: {missing}"


def test_the_promises_table_names_a_test_in_every_row():
    text = (REPO / "docs" / "reliability.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| promise") and not line.startswith("| ---")]
    assert len(rows) > 40
    assert [row for row in rows if not TEST_REFERENCE.search(row)] == []
