"""The library stands under its Prefect shell: no module of generation_core imports flows/,
tasks/ or infra/ (not even inside a function), and its modules import each other without a
cycle. Read from the source, so a hidden import counts too."""

import ast
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

PACKAGE = Path(__file__).resolve().parent.parent / "generation_core"


def _module_imports() -> dict[str, set[str]]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        modules[name] = path
    imports = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                found |= {
                    f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules else node.module
                    for alias in node.names
                }
            elif isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
        imports[name] = found
    return imports


def test_the_library_never_imports_its_prefect_shell():
    upward = {
        name: sorted(i for i in found if i.split(".")[0] in ("flows", "tasks", "infra"))
        for name, found in _module_imports().items()
    }
    assert {name: found for name, found in upward.items() if found} == {}


def test_the_library_has_no_import_cycle():
    imports = _module_imports()
    graph = {name: {i for i in found if i in imports and i != name} for name, found in imports.items()}
    cycles, state = [], {}

    def visit(name, stack):
        state[name] = "open"
        stack.append(name)
        for dependency in sorted(graph[name]):
            if state.get(dependency) == "open":
                cycles.append(stack[stack.index(dependency) :] + [dependency])
            elif dependency not in state:
                visit(dependency, stack)
        stack.pop()
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [])
    assert cycles == []


def test_what_an_engine_replica_process_loads_imports_no_verl():
    """An engine's replica process imports the server actor's module and its engine's
    (engines/server.py): with them, anything they import. verl's import costs seconds of CPU in
    every replica (tensordict, torch._dynamo) and none of it is used there."""
    imports = _module_imports()
    loaded, todo = (
        set(),
        ["generation_core.engines.server", "generation_core.engines.instant", "generation_core.engines.hf.engine"],
    )
    while todo:
        name = todo.pop()
        if name not in loaded:
            loaded.add(name)
            todo += [i for i in imports[name] if i in imports]
    assert {
        name: sorted(i for i in imports[name] if i.split(".")[0] == "verl")
        for name in sorted(loaded)
        if any(i.split(".")[0] == "verl" for i in imports[name])
    } == {}
    assert "generation_core.engines.server" in loaded and "generation_core.engines.base" in loaded


# The rooms of generation_core from the ground up: a module imports from its own room or from
# rooms below it, never above (docs/architecture.md shows the same order). The top-level
# modules are the ground, except run_plan.py, the run's vocabulary, which names a run folder
# (store) and stands between store and the rooms that read a plan.
ROOM_ORDER = [
    "ground",
    "config",
    "store",
    "run_plan",
    "inputs",
    "engines",
    "serving",
    "shard",
    "preflight",
    "outputs",
    "exports",
    "report",
    "driver",
    "benchmark",
]


def _room(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 2 and parts[1] not in ROOM_ORDER:
        return "ground"
    return parts[1]


def test_every_module_imports_only_its_own_room_or_rooms_below():
    upward = sorted(
        f"{name} imports {found}"
        for name, imports in _module_imports().items()
        if name != "generation_core"
        for found in imports
        if found.startswith("generation_core.") and ROOM_ORDER.index(_room(found)) > ROOM_ORDER.index(_room(name))
    )
    assert upward == []
    assert {_room(name) for name in _module_imports() if name != "generation_core"} == set(ROOM_ORDER)


def test_nothing_in_the_pipeline_imports_the_bench_or_reads_its_figures():
    """Issue 53 item 5: `genrun bench` is a user command beside the pipeline. Its room is the top
    one, so no other module of generation_core imports it, and none reads its figures (bench.json:
    the report stopped showing them)."""
    assert ROOM_ORDER[-1] == "benchmark"
    importers = sorted(
        name
        for name, found in _module_imports().items()
        if not name.startswith("generation_core.benchmark")
        and any(module.startswith("generation_core.benchmark") for module in found)
    )
    assert importers == []
    readers = sorted(
        str(path.relative_to(PACKAGE.parent))
        for path in PACKAGE.rglob("*.py")
        if "benchmark" not in path.relative_to(PACKAGE).parts and "bench.json" in path.read_text()
    )
    assert readers == []


# Size that hides more than one job: a function longer than this says why in its docstring (a
# line starting "Long:"), and a module over MODULE_LINES is named here with the one thing it owns.
FUNCTION_LINES = 60
MODULE_LINES = 400
ONE_JOB_THOUGH_LONG = {
    "generation_core/engines/hf/engine.py": "one engine: its request queue, decode loop and KV bookkeeping share one thread's state",
    "generation_core/store/folder.py": "StorageFolder and the two atomic writers (local rename, S3 multipart) its `open_write` returns",
    "generation_core/store/commit_log.py": "a shard's commit records and their fold; repair and fencing live beside it",
    "generation_core/config/settings.py": "the generation: section, each of its 33 keys declared once (default, rule, doc)",
}


def test_no_function_is_long_without_saying_why():
    long = []
    for path in sorted(PACKAGE.parent.glob("*/**/*.py")):
        if path.parts[len(PACKAGE.parent.parts)] not in ("generation_core", "flows", "tasks"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
                and node.end_lineno - node.lineno + 1 > FUNCTION_LINES
                and "\nLong:" not in "\n" + (ast.get_docstring(node) or "")
            ):
                long.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name}")
    assert long == []


def test_no_module_is_long_unless_it_owns_one_thing():
    long = {
        str(path.relative_to(PACKAGE.parent))
        for path in PACKAGE.rglob("*.py")
        if len(path.read_text().splitlines()) > MODULE_LINES
    }
    assert sorted(long - set(ONE_JOB_THOUGH_LONG)) == []
    assert sorted(set(ONE_JOB_THOUGH_LONG) - long) == [], "no longer long: drop it from ONE_JOB_THOUGH_LONG"


def _room_lines(path: str) -> int:
    """Lines of a room's modules: a folder's own modules (not its sub-rooms), or the top-level modules."""
    root = PACKAGE.parent / path.rstrip("/").removesuffix("/*.py")
    files = root.glob("*.py")
    return sum(len(file.read_text().splitlines()) for file in files)


def test_every_room_is_within_its_budget():
    page = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    rows = re.findall(r"^\| [\w/]+ \| `([^`]+)` \| [\d,]+ \| [\d,]+ \| ([\d,]+) \|", page, flags=re.MULTILINE)
    assert len(rows) >= 14, "docs/architecture.md lost its room budgets"
    over = {
        path: (_room_lines(path), int(budget.replace(",", "")))
        for path, budget in rows
        if _room_lines(path) > int(budget.replace(",", ""))
    }
    assert over == {}, "a room grew past its budget: raise it in docs/architecture.md and say why, or cut"
