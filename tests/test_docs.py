"""The docs stay true to the code they describe, checked without running anything (no Ray).

- The docs name the tests that hold their promises (docs/reliability.md, the README): every
  `tests/<file>.py::<test>` they name must exist, so renaming or deleting a test cannot leave a
  promise without its holder unnoticed.
- Every relative link of the README and docs/ reaches a file (and a heading, when it names one).
- docs/configuration.md names only keys the loaded configuration has, and every `generation.*`
  key as declared; no doc names a key that does not exist.
- docs/architecture.md names every module under generation_core/, flows/ and tasks/, and no
  module that does not exist; no docstring or comment of the library names a file that is gone."""

from __future__ import annotations

import ast
import io
import re
import sys
import sysconfig
import tokenize
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.timeout(60)

TEST_REFERENCE = re.compile(r"(tests/[\w/]+\.py)::(\w+)")
DOCS = ["README.md", "CHANGELOG.md", *(str(path.relative_to(REPO)) for path in sorted((REPO / "docs").glob("*.md")))]


def _test_names(path: str) -> set[str]:
    tree = ast.parse((REPO / path).read_text())
    return {
        node.name
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test_")
    }


@pytest.mark.parametrize("doc", DOCS)
def test_every_test_a_doc_names_exists(doc):
    references = TEST_REFERENCE.findall((REPO / doc).read_text())
    missing = [
        f"{path}::{name}" for path, name in references if not (REPO / path).exists() or name not in _test_names(path)
    ]
    assert not missing, f"{doc} names tests that do not exist: {missing}"


def _promise_rows(text: str) -> list[str]:
    """The body rows of every table headed `| promise | held by |` (other tables, such as the
    fault table, describe and hold nothing)."""
    rows, in_promises = [], False
    for line in text.splitlines():
        if not line.startswith("|"):
            in_promises = False
        elif line.startswith("| promise"):
            in_promises = True
        elif in_promises and not line.startswith("| ---"):
            rows.append(line)
    return rows


def test_the_promises_table_names_a_test_in_every_row():
    text = (REPO / "docs" / "reliability.md").read_text()
    rows = _promise_rows(text)
    assert len(rows) > 40
    assert [row for row in rows if not TEST_REFERENCE.search(row)] == []


# The README and docs/ link each other and the repository by relative paths; a moved page or
# file must not leave a dead link. Anchors (#section) are checked against the target's headings
# as GitHub renders them.
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation but - and _ dropped, spaces to -."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path) -> set[str]:
    return {_github_anchor(line.lstrip("#")) for line in path.read_text().splitlines() if re.match(r"#{1,6} ", line)}


@pytest.mark.parametrize("doc", DOCS)
def test_every_relative_link_points_to_an_existing_file(doc):
    source = REPO / doc
    dead = []
    for target in LINK.findall(source.read_text()):
        if re.match(r"[a-z]+:", target):  # http(s), mailto: not ours to check
            continue
        file_part, _, anchor = target.partition("#")
        resolved = (source.parent / file_part).resolve() if file_part else source
        if not resolved.exists():
            dead.append(target)
        elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
            dead.append(target)
    assert not dead, f"{doc} links to files or sections that do not exist: {dead}"


# docs/configuration.md is the key reference: it must not name a key the loaded configuration
# lacks, and it must cover every generation.* key genrun.yaml defines (genrun's own section).
CONFIG_KEY = re.compile(
    r"`((?:trainer|data|actor_rollout_ref|generation|storage|ray_kwargs|reward|custom_reward_function)\.[\w.]*\w)(?:=[^`]*)?`"
)
# Sections whose keys are free-form (fsspec, ray.init, verl's engine options, a reward's kwargs):
# a doc may name a key under them that the defaults do not hold.
FREE_FORM_PREFIXES = (
    "storage.options.",
    "data.storage_options.",
    "ray_kwargs.ray_init.",
    "reward.custom_reward_function.reward_kwargs",
    "custom_reward_function.reward_kwargs",
    "actor_rollout_ref.rollout.custom",
    "actor_rollout_ref.rollout.engine_kwargs.sglang.",
    "actor_rollout_ref.rollout.engine_kwargs.vllm.",
)


@pytest.fixture(scope="module")
def loaded_config():
    from generation_core.config.loading import load_config

    return load_config([])


@pytest.mark.timeout(180)
@pytest.mark.parametrize("doc", DOCS)
def test_every_config_key_a_doc_names_exists(doc, loaded_config):
    from omegaconf import OmegaConf

    absent = object()
    named = sorted(set(CONFIG_KEY.findall((REPO / doc).read_text())))
    unknown = [
        key
        for key in named
        if not key.startswith(FREE_FORM_PREFIXES)
        and OmegaConf.select(loaded_config, key, default=absent, throw_on_missing=False) is absent
    ]
    assert not unknown, f"{doc} names config keys the loaded configuration does not have: {unknown}"


KEY_TABLE = re.compile(r"(<!-- key_table ([\w.]+):[^\n]*-->\n)((?:\|[^\n]*\n)*)")
"""A table of genrun's own keys in docs/configuration.md: its marker line, its section, its rows."""


def with_key_tables(page: str, declared: dict[str, type] | None = None) -> str:
    """The configuration page with each marked table as its section's declarations give it
    (`checks.key_table`); `python -m tests.test_docs` writes it."""
    from generation_core.config.checks import key_table
    from generation_core.config.settings import DECLARED

    sections = DECLARED if declared is None else declared
    return KEY_TABLE.sub(lambda found: found[1] + key_table(found[2], sections[found[2]]), page)


def test_the_configuration_page_tables_every_declared_key_as_declared():
    """Issue 53 item 1: a generation: key was written in five places (field, rule, genrun.yaml,
    this page, the fingerprint's OPERATIONAL_KEYS); now its declaration is the one, and each table
    of genrun's own keys on the page is the one its declarations give."""
    from generation_core.config.settings import DECLARED

    page = (REPO / "docs" / "configuration.md").read_text()
    assert sorted(found[2] for found in KEY_TABLE.finditer(page)) == sorted(DECLARED), "one marked table per section"
    assert page == with_key_tables(page), "docs/configuration.md: run `.venv/bin/python -m tests.test_docs`"


# docs/architecture.md's module map names every module; the list comes from the file system at
# test time, so a module added (or renamed) without its line on the page fails here.
MODULE_ROOTS = ("generation_core", "flows", "tasks")
MODULE_NAME = re.compile(r"`((?:generation_core|flows|tasks)/[\w/]*(?:\.py|/))`")


def _module_names() -> set[str]:
    """Each module as the page names it: its path, a package with code by its folder (`config/`)."""
    names = set()
    for root in MODULE_ROOTS:
        for path in (REPO / root).rglob("*.py"):
            relative = path.relative_to(REPO)
            if path.name != "__init__.py":
                names.add(str(relative))
            elif ast.parse(path.read_text()).body:
                names.add(f"{relative.parent}/")
    return names


def test_the_architecture_page_names_every_module_and_only_modules_that_exist():
    page = set(MODULE_NAME.findall((REPO / "docs" / "architecture.md").read_text()))
    modules = _module_names()
    assert len(modules) > 50
    assert sorted(modules - page) == [], "modules missing from docs/architecture.md's module map"
    assert sorted(page - modules) == [], "docs/architecture.md names modules that do not exist"


# The library's docstrings and comments name files (`store/run_folder.py`, verl's
# `verl/protocol.py`): a module renamed or removed must not leave its old name behind for a reader to
# look for in vain. A bare name is a module of the library; a path is a file of this repository or
# of an installed package.
FILE_NAME = re.compile(r"(?<![\w./-])((?:[\w-]+/)*\w+\.py)\b")


def _comments_and_docstrings(path: Path) -> list[tuple[int, str]]:
    source = path.read_text()
    found = [
        (token.start[0], token.string)
        for token in tokenize.generate_tokens(io.StringIO(source).readline)
        if token.type == tokenize.COMMENT
    ]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Module | ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            docstring = ast.get_docstring(node, clean=False)
            if docstring:
                found.append((node.body[0].lineno, docstring))
    return found


def test_every_file_a_docstring_or_comment_names_exists():
    library = [path for root in MODULE_ROOTS for path in sorted((REPO / root).rglob("*.py"))]
    module_names = {path.name for path in library}
    repo_files = {
        str(path.relative_to(REPO))
        for root in (*MODULE_ROOTS, "tests", "bench", "examples")
        for path in (REPO / root).rglob("*.py")
    }
    installed = Path(sysconfig.get_paths()["purelib"])

    def exists(name: str) -> bool:
        if "/" not in name:
            return name in module_names
        return any(f == name or f.endswith("/" + name) for f in repo_files) or (installed / name).is_file()

    stale = [
        f"{path.relative_to(REPO)}:{line} names {name}"
        for path in library
        for line, text in _comments_and_docstrings(path)
        for name in FILE_NAME.findall(text)
        if not exists(name)
    ]
    assert stale == []


QUALIFIED_CONSTANT = re.compile(r"\b([a-z_][a-z0-9_]*)\.([A-Z][A-Z0-9_]{2,})\b")


def _prose(path: Path) -> list[tuple[int, str]]:
    """Comments, docstrings and the strings that document an assignment."""
    found = _comments_and_docstrings(path)
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            found.append((node.lineno, node.value.value))
    return found


def _top_level_names(path: Path) -> set[str]:
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            names.add(node.name)
        for target in node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]:
            if isinstance(target, ast.Name):
                names.add(target.id)
    return names


def test_every_module_constant_a_docstring_or_comment_names_exists():
    """Review 2026-11-28 §6.8: `records.PROVENANCE_KEYS` outlived the records module (now
    store/trajectory_record.py) in two docstrings, which the file-name check cannot see: a
    `module.CONSTANT` in the library's prose names a library module that defines it, or a module the
    file imports (os.O_CREAT)."""
    library = sorted((REPO / "generation_core").rglob("*.py"))
    defined: dict[str, set[str]] = {}
    for path in library:
        stem = path.parent.name if path.name == "__init__.py" else path.stem
        defined.setdefault(stem, set()).update(_top_level_names(path))
    stale = []
    for path in library:
        tree = ast.parse(path.read_text())
        imported = {
            (alias.asname or alias.name).split(".")[0]
            for node in ast.walk(tree)
            if isinstance(node, ast.Import | ast.ImportFrom)
            for alias in node.names
        }
        for line, text in _prose(path):
            for module, name in QUALIFIED_CONSTANT.findall(text):
                known = module in imported or module in sys.stdlib_module_names
                if module in defined and name not in defined[module] or module not in defined and not known:
                    stale.append(f"{path.relative_to(REPO)}:{line} names {module}.{name}")
    assert stale == []


if __name__ == "__main__":
    CONFIGURATION = REPO / "docs" / "configuration.md"
    CONFIGURATION.write_text(with_key_tables(CONFIGURATION.read_text()))
