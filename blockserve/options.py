"""Options declared once: a dataclass field carries its help, choices and check, and both the
command line and keyword arguments are generated from it."""

from __future__ import annotations

import argparse
import dataclasses
import math
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from blockserve.errors import InvalidConfigError

Check = Callable[[Any], str | None]  # a problem to report, or None when the value is fine


@dataclass(frozen=True, slots=True)
class Option:
    """What a field means to a user: its help, its allowed values, its extra check.

    `option(...)` builds such a field; `add_arguments` turns a dataclass's options into argparse
    flags (kebab-case, vLLM's names), `from_namespace` reads them back, and `validate` checks
    every value, raising InvalidConfigError that names the field and its flag. Imports no torch.
    """

    help: str
    choices: tuple[str, ...] | None = None
    check: Check | None = None
    exclusive_group: str | None = None  # at most one field of a group may be set


def option(
    default: Any,
    help: str,
    *,
    choices: tuple[str, ...] | None = None,
    check: Check | None = None,
    exclusive_group: str | None = None,
    secret: bool = False,
) -> Any:
    """A dataclass field with a default and an `Option` describing it; a `secret` one is left
    out of the dataclass's repr (a key or password must not reach a log)."""
    return dataclasses.field(
        default=default,
        repr=not secret,
        metadata={
            "option": Option(
                help=help, choices=choices, check=check, exclusive_group=exclusive_group
            )
        },
    )


def positive(value: Any) -> str | None:
    return None if value is None or value > 0 else f"must be positive, got {value!r}"


def at_least(minimum: int) -> Check:
    def check(value: Any) -> str | None:
        return None if value is None or value >= minimum else f"must be >= {minimum}"

    return check


def finite_non_negative(value: float) -> str | None:
    if math.isfinite(value) and value >= 0:
        return None
    return f"must be a finite number >= 0, got {value!r}"


def share(value: float) -> str | None:
    return None if 0 < value <= 1 else f"must be in (0, 1], got {value:g}"


def non_empty_or_none(value: str | None) -> str | None:
    return None if value is None or value else "must not be empty"


def host_names(values: tuple[str, ...]) -> str | None:
    if isinstance(values, tuple) and all(isinstance(v, str) and v for v in values):
        return None
    return f"must be a tuple of host names, got {values!r}"


def positive_each(values: tuple[int, ...]) -> str | None:
    if all(value > 0 for value in values):
        return None
    return f"must be positive, got {' '.join(map(str, values))}"


def declared(cls: type, name: str) -> Any:
    """The option `cls` declares as `name`, as a field of another dataclass: `EngineArgs`
    takes each config's options this way, their default, help and check written once."""
    source = cls.__dataclass_fields__[name]  # type: ignore[attr-defined]
    return dataclasses.field(default=source.default, repr=source.repr, metadata=source.metadata)


def options_of(cls: type, values: Any) -> dict[str, Any]:
    """The values of `cls`'s options, read by name from `values` (an `EngineArgs`)."""
    return {
        f.name: getattr(values, f.name) for f in dataclasses.fields(cls) if "option" in f.metadata
    }


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def _options(cls: type) -> list[tuple[dataclasses.Field, Option, Any]]:
    hints = typing.get_type_hints(cls)
    return [
        (f, f.metadata["option"], hints[f.name])
        for f in dataclasses.fields(cls)
        if "option" in f.metadata
    ]


def _is_list(hint: Any) -> bool:
    """A `tuple[X, ...]` field: a flag that may be repeated."""
    return typing.get_origin(hint) is tuple


def _item_type(hint: Any) -> type:
    """The type of a `tuple[X, ...]` field's items (str unless X is int or float; the check
    of a field of strings says what its strings must be)."""
    item = typing.get_args(hint)[0]
    return item if item in (int, float) else str


def _scalar_type(hint: Any) -> type | None:
    """The one non-None type of a field's annotation (`int | None` → int); None when the
    field takes several types (its check decides)."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return args[0] if len(args) == 1 else None
    return hint if isinstance(hint, type) else None


def add_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """One flag per option of `cls`; booleans get `--x / --no-x`."""
    groups: dict[str, Any] = {}
    for f, opt, hint in _options(cls):
        target: Any = parser
        if opt.exclusive_group is not None:
            if opt.exclusive_group not in groups:
                groups[opt.exclusive_group] = parser.add_mutually_exclusive_group()
            target = groups[opt.exclusive_group]
        kind = _scalar_type(hint)
        default_text = "" if f.default is None else f" (default: {f.default})"
        kwargs: dict[str, Any] = {"dest": f.name, "default": f.default}
        if _is_list(hint):  # one or more values, the flag repeatable; argparse makes the list
            item = _item_type(hint)
            kwargs.update(action="extend", nargs="+", default=None, type=item, help=opt.help)
        elif kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
            kwargs["help"] = opt.help + default_text
        else:
            kwargs["type"] = kind if kind in (int, float) else str
            kwargs["help"] = opt.help + default_text
            if opt.choices is not None:
                kwargs["choices"] = list(opt.choices)
        target.add_argument(flag_name(f.name), **kwargs)


def from_namespace(cls: type, namespace: argparse.Namespace) -> Any:
    """An instance of `cls` from the flags `add_arguments` declared (other attributes ignored)."""
    values = {}
    for f, _, hint in _options(cls):
        value = getattr(namespace, f.name)
        if _is_list(hint):
            value = f.default if value is None else tuple(value)
        values[f.name] = value
    return cls(**values)


def validate(instance: Any) -> None:
    """Check every option's type, choices and check; the first problem raises
    InvalidConfigError naming the field and its flag."""
    set_in_group: dict[str, str] = {}
    for f, opt, hint in _options(type(instance)):
        value = getattr(instance, f.name)
        problem = _problem(value, opt, hint)
        if problem is not None:
            raise InvalidConfigError(f"{f.name} ({flag_name(f.name)}) {problem}")
        if opt.exclusive_group is not None and value is not None:
            other = set_in_group.setdefault(opt.exclusive_group, f.name)
            if other != f.name:
                raise InvalidConfigError(
                    f"{other} ({flag_name(other)}) and {f.name} ({flag_name(f.name)}) "
                    "cannot both be set"
                )


def _problem(value: Any, opt: Option, hint: Any) -> str | None:
    if value is None:
        allows_none = type(None) in typing.get_args(hint)
        return None if allows_none else "must be set"
    kind = _scalar_type(hint)
    if kind is not None and not _is_instance(value, kind):
        return f"must be of type {kind.__name__}, got {value!r}"
    if (
        _is_list(hint)
        and _item_type(hint) is not str
        and not (
            isinstance(value, (tuple, list))
            and all(_is_instance(item, _item_type(hint)) for item in value)
        )
    ):
        return f"must be a tuple of {_item_type(hint).__name__}, got {value!r}"
    if opt.choices is not None and value not in opt.choices:
        return f"must be one of {', '.join(opt.choices)}, got {value!r}"
    return opt.check(value) if opt.check is not None else None


def _is_instance(value: Any, kind: type) -> bool:
    if isinstance(value, bool):  # a bool is an int to Python, never to an option
        return kind is bool
    if kind is float:
        return isinstance(value, (int, float))
    return isinstance(value, kind)
