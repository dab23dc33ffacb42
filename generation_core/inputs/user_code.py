"""The user's code that shapes trajectories, as one digest for the run fingerprint.

A tool class, a reward file's helper module, an agent loop from a `verl.plugins` entry point:
change any of them and the output changes, so they are inputs like the dataset. Hashed: the
source of every module file outside site-packages, the standard library and genrun itself that
a named class lives in (tool `class_name`s, agent-loop `_target_`s, plugin entry points) or that
a user file (reward, function tools, custom dataset class) imports, transitively. Imports are
read with `ast` and resolved without running code: a module the process imported already
(preflight's check_run_code loads the same code first) by its `__file__`, else by the import
system's finders with the user file's folder first on the path. A named class that lives in an
installed package enters by its distribution's name and version instead; one of genrun's own
pinned packages (plan.versions) is there already. Imports computed at run time
(`importlib.import_module(name)`) are not seen.

Modules enter by name and content, not path: the same code in another checkout is the same run.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib.machinery
import importlib.util
import os
import site
import sys
import sysconfig
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from generation_core.build import OWN_PACKAGES, SOURCE_ROOT


@functools.cache
def _roots() -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """(installed package roots, standard library roots, genrun's own package roots), each with a trailing separator."""
    paths = sysconfig.get_paths()
    installed = {paths["purelib"], paths["platlib"], *site.getsitepackages()}
    stdlib = {paths["stdlib"], paths["platstdlib"]}
    own = {str(SOURCE_ROOT / package) for package in OWN_PACKAGES}

    def normal(folders):
        return tuple(os.path.join(str(Path(f).resolve()), "") for f in folders if f)

    return normal(installed), normal(stdlib), normal(own)


def _is_installed(path: str) -> bool:
    parts = Path(path).parts
    return "site-packages" in parts or "dist-packages" in parts or path.startswith(_roots()[0])


def _is_local(path: str) -> bool:
    """A module file of the user's: not installed, not the standard library, not genrun's own."""
    installed, stdlib, own = _roots()
    return not (_is_installed(path) or path.startswith(stdlib) or path.startswith(own))


@dataclass
class CodeInputs:
    """What the walk found: local module sources by module name (sha256 of the file), and the
    installed distributions (name -> version) that named classes come from."""

    sources: dict[str, str] = field(default_factory=dict)
    distributions: dict[str, str] = field(default_factory=dict)

    def digest(self) -> str | None:
        """One digest of both, None when there is no user code (the fingerprint stays as it was)."""
        if not self.sources and not self.distributions:
            return None
        digest = hashlib.sha256()
        for name, source in sorted(self.sources.items()):
            digest.update(f"module\0{name}\0{source}\0".encode())
        for name, version in sorted(self.distributions.items()):
            digest.update(f"dist\0{name}\0{version}\0".encode())
        return digest.hexdigest()


class CodeWalk:
    """Collects CodeInputs from user files and named modules; each local file is read once."""

    def __init__(self, already_versioned: Iterable[str] = ()):
        self.found = CodeInputs()
        self._already_versioned = {name.lower() for name in already_versioned}
        self._walked: set[str] = set()
        self._distributions: Mapping[str, list[str]] | None = None

    def add_file(self, path: str | Path) -> None:
        """A user file loaded by path (reward, function tools): the local modules it imports.
        Its own content is hashed by the caller (fingerprint.OUTPUT_FILES)."""
        path = Path(path).resolve()
        self._walk(path, package=None, search=[str(path.parent)])

    def add_module(self, name: str, *, named: bool = False, search: list[str] | None = None) -> None:
        """A module by its import name, with its parent packages (importing it runs them). A
        `named` module (a class the config names, a plugin) in an installed package enters by
        its distribution."""
        parts = name.split(".")
        for depth in range(1, len(parts) + 1):
            module_name = ".".join(parts[:depth])
            if module_name in self.found.sources:
                continue  # hashed and walked already
            origin, locations = _find(module_name, search or [])
            if origin is None:
                if locations is None:
                    return  # not found (an optional import), built-in or frozen
                continue  # a namespace package: no file of its own
            if _is_local(origin):
                self.found.sources[module_name] = hashlib.sha256(Path(origin).read_bytes()).hexdigest()
                package = module_name if locations is not None else module_name.rpartition(".")[0]
                self._walk(Path(origin), package=package, search=search or [])
            elif named and depth == len(parts) and _is_installed(origin):
                self._add_distribution(parts[0])

    def _add_distribution(self, top_level: str) -> None:
        if top_level.lower() in self._already_versioned:
            return  # verl's own tools and loops: its version is in the fingerprint (and no scan of every distribution)
        if self._distributions is None:
            self._distributions = metadata.packages_distributions()
        for dist_name in self._distributions.get(top_level, []):
            if dist_name.lower() not in self._already_versioned:
                try:
                    self.found.distributions[dist_name] = metadata.version(dist_name)
                except metadata.PackageNotFoundError:
                    continue

    def add_distribution(self, dist_name: str, version: str) -> None:
        if dist_name.lower() not in self._already_versioned:
            self.found.distributions[dist_name] = version

    def add_entry_point(self, entry_point: metadata.EntryPoint) -> None:
        """A `verl.plugins` entry point: its module when local, else its distribution."""
        origin, _ = _find(entry_point.module, [])
        if origin is not None and _is_local(origin):
            self.add_module(entry_point.module)
        elif entry_point.dist is not None:
            self.add_distribution(entry_point.dist.name, entry_point.dist.version)

    def _walk(self, path: Path, package: str | None, search: list[str]) -> None:
        key = str(path)
        if key in self._walked:
            return
        self._walked.add(key)
        try:
            tree = ast.parse(path.read_bytes(), filename=key)
        except (SyntaxError, ValueError):
            return  # its bytes are hashed; a file Python cannot parse imports nothing
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    self.add_module(alias.name, search=search)
            elif isinstance(node, ast.ImportFrom):
                base = _absolute(node.module, node.level, package)
                if base is None:
                    continue
                self.add_module(base, search=search)
                # `from pkg import name`: name may be a submodule.
                for alias in node.names:
                    if alias.name != "*" and _find(f"{base}.{alias.name}", search) != (None, None):
                        self.add_module(f"{base}.{alias.name}", search=search)


def _absolute(module: str | None, level: int, package: str | None) -> str | None:
    """The absolute name of `from <level dots><module> import ...` in `package` (None: unresolvable,
    e.g. a relative import in a file loaded by path)."""
    if level == 0:
        return module
    if not package:
        return None
    parts = package.split(".")
    if level - 1 >= len(parts):
        return None
    base = ".".join(parts[: len(parts) - (level - 1)])
    return f"{base}.{module}" if module else base


def _find(name: str, search: list[str]) -> tuple[str | None, list[str] | None]:
    """(module file, submodule search locations) of a module, without importing it: the loaded
    module's, else the finders' answer (a parent is found the same way, its locations searched).
    (None, None) when it cannot be found."""
    module = sys.modules.get(name)
    if module is not None:
        origin = getattr(module, "__file__", None)
        locations = getattr(module, "__path__", None)
        return (str(Path(origin).resolve()) if origin else None), (list(locations) if locations is not None else None)
    parent, _, _ = name.rpartition(".")
    if parent:
        _, parent_locations = _find(parent, search)
        spec = importlib.machinery.PathFinder.find_spec(name, parent_locations) if parent_locations else None
    else:
        spec = importlib.machinery.PathFinder.find_spec(name, search) if search else None
        if spec is None:
            try:
                # The whole import system (editable installs' finders too); for a top-level name it runs no code.
                spec = importlib.util.find_spec(name)
            except (ImportError, ValueError):
                spec = None
    if spec is None:
        return None, None
    origin = str(Path(spec.origin).resolve()) if spec.origin and spec.has_location else None
    return origin, (list(spec.submodule_search_locations) if spec.submodule_search_locations is not None else None)
