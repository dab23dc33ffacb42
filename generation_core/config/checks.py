"""The settings' declarations and checks, one vocabulary. Each key of genrun's own sections is
declared once, as a dataclass field made by `key`: its default, its rule (a test, and what the
value must be), whether it shapes output, and one line of doc. Everything else is derived from
that declaration: the refusal of a value that breaks the rule (`refuse_bad_values`, as the
settings are built), the config's defaults (`defaults_of`, merged by load_config), the
fingerprint's operational keys (`operational_keys`) and the reference table in
docs/configuration.md (`key_table`, held by tests/test_docs.py). Light to import (the standard
library only)."""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any

from generation_core.errors import GenrunError

Rule = tuple[Callable[[Any], bool], str]
"""A setting's test and what it must be (the second half of its refusal)."""


def is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def is_bool(value: Any) -> bool:
    return isinstance(value, bool)


def integer(minimum: int, *, null: bool = False) -> Callable[[Any], bool]:
    """An integer >= minimum (a bool is not one), or None where `null`."""
    return lambda value: (
        (null and value is None) or (isinstance(value, int) and not isinstance(value, bool) and value >= minimum)
    )


def number(minimum: float = 0.0, *, above: bool = True, null: bool = False) -> Callable[[Any], bool]:
    """A number over `minimum` (`above`) or at least it, or None where `null`."""
    return lambda value: (
        (null and value is None) or (is_number(value) and (value > minimum if above else value >= minimum))
    )


def one_of(*values: Any) -> Rule:
    return (lambda value: value in values, f"must be one of {', '.join(map(str, values))}")


BOOL: Rule = (is_bool, "must be true or false")


@dataclass(frozen=True)
class Key:
    """What a settings field declares beside its default (`key` makes the field)."""

    rule: Rule
    shapes_output: bool
    """True: a change gives other trajectories, so it is in the run fingerprint (a new folder);
    False: operational (how the run executes), a resumed run may change it."""
    doc: str
    """One line for docs/configuration.md's table."""


def key(default: Any, rule: Rule, shapes_output: bool, doc: str) -> Any:
    """A settings field declared once: its default, its rule, whether it shapes output, its doc."""
    metadata = {"key": Key(rule, shapes_output, doc)}
    if isinstance(default, list | dict):
        return field(default_factory=lambda: copy.deepcopy(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def declared(cls: type) -> dict[str, tuple[Field, Key]]:
    """Each field of a settings class with its declaration (a field made without `key` is refused)."""
    found = {}
    for each in fields(cls):
        if not isinstance(each.metadata.get("key"), Key):
            raise TypeError(f"{cls.__name__}.{each.name} is not declared with config.checks.key")
        found[each.name] = (each, each.metadata["key"])
    return found


def default_of(each: Field) -> Any:
    return each.default_factory() if each.default_factory is not MISSING else each.default


def defaults_of(cls: type) -> dict[str, Any]:
    """The section's keys with their defaults, as load_config merges them into the config."""
    return {name: default_of(each) for name, (each, _) in declared(cls).items()}


def operational_keys(section: str, cls: type) -> list[str]:
    """The section's keys that do not shape output (left out of the run fingerprint)."""
    return [f"{section}.{name}" for name, (_, declaration) in declared(cls).items() if not declaration.shapes_output]


def key_table(section: str, cls: type) -> str:
    """The section's reference table for docs/configuration.md (tests/test_docs.py holds the page to it)."""
    lines = ["| key | default | kind | meaning |", "| --- | --- | --- | --- |"]
    for name, (each, declaration) in declared(cls).items():
        kind = "output" if declaration.shapes_output else "operational"
        lines.append(f"| `{section}.{name}` | {_yaml_value(default_of(each))} | {kind} | {declaration.doc} |")
    return "\n".join(lines) + "\n"


def _yaml_value(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return f"`{value}`" if isinstance(value, str | list | dict) else str(value)


def refuse_bad_values(settings: Any, section: str) -> None:
    """The first field of `settings` that breaks its declared rule, refused in one line: `invalid
    <section>.<name>=<value>: <what it must be>`."""
    for name, (_, declaration) in declared(type(settings)).items():
        value = getattr(settings, name)
        ok, rule = declaration.rule
        if not ok(value):
            raise GenrunError(f"invalid {section}.{name}={value!r}: {rule}")


def section_of(mapping: Mapping[str, Any] | None, cls: type) -> dict[str, Any]:
    """The keys of `mapping` that are fields of `cls`. A key absent keeps the field's default: a
    run.json written by an older genrun may lack keys added since."""
    names = {f.name for f in fields(cls)}
    return {key: value for key, value in (mapping or {}).items() if key in names}
