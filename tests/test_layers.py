"""The library stands under its Prefect shell: no module of generation_core imports flows/,
tasks/ or infra/ (not even inside a function), and its modules import each other without a
cycle. Read from the source, so a hidden import counts too."""

import ast
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
                found |= {f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules else node.module for alias in node.names}
            elif isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
        imports[name] = found
    return imports


def test_the_library_never_imports_its_prefect_shell():
    upward = {name: sorted(i for i in found if i.split(".")[0] in ("flows", "tasks", "infra")) for name, found in _module_imports().items()}
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
                cycles.append(stack[stack.index(dependency):] + [dependency])
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
    loaded, todo = set(), ["generation_core.engines.server", "generation_core.engines.instant", "generation_core.engines.hf"]
    while todo:
        name = todo.pop()
        if name not in loaded:
            loaded.add(name)
            todo += [i for i in imports[name] if i in imports]
    assert {name: sorted(i for i in imports[name] if i.split(".")[0] == "verl") for name in sorted(loaded) if any(i.split(".")[0] == "verl" for i in imports[name])} == {}
    assert "generation_core.engines.server" in loaded and "generation_core.engines.base" in loaded
