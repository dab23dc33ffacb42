"""The settings' checks, one vocabulary: a rule per key (a test, and what the value must be) and
the one-line refusal of a value that breaks it. The settings dataclasses (settings.py,
engine_kwargs.py) run their rules as they are built; light to import (the standard library only)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import fields
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


def refuse_bad_values(settings: Any, section: str, rules: Mapping[str, Rule]) -> None:
    """The first field of `settings` that breaks its rule, refused in one line: `invalid
    <section>.<name>=<value>: <what it must be>`."""
    for name, (ok, rule) in rules.items():
        value = getattr(settings, name)
        if not ok(value):
            raise GenrunError(f"invalid {section}.{name}={value!r}: {rule}")


def section_of(mapping: Mapping[str, Any] | None, cls: type) -> dict[str, Any]:
    """The keys of `mapping` that are fields of `cls`. A key absent keeps the field's default: a
    run.json written by an older genrun may lack keys added since."""
    names = {f.name for f in fields(cls)}
    return {key: value for key, value in (mapping or {}).items() if key in names}
