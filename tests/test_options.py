"""Options declared once on a dataclass: flags generated from them, values checked by them."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import pytest

from blockserve.errors import InvalidConfigError
from blockserve.options import add_arguments, at_least, from_namespace, option, positive, validate


@dataclass(frozen=True)
class Sample:
    size: int = option(4, "how big", check=positive)
    mode: str = option("a", "which mode", choices=("a", "b"))
    ratio: float = option(0.5, "a fraction")
    verbose: bool = option(False, "talk more")
    limit: int | None = option(None, "an optional cap", check=at_least(2), exclusive_group="cap")
    budget: int | None = option(None, "another cap", exclusive_group="cap")
    tags: tuple[str, ...] = option((), "repeatable")
    internal: int = 0  # no option: no flag


def parse(*argv: str) -> Sample:
    parser = argparse.ArgumentParser()
    add_arguments(parser, Sample)
    return from_namespace(Sample, parser.parse_args(list(argv)))  # type: ignore[no-any-return]


def test_flags_are_kebab_case_with_the_fields_defaults() -> None:
    """No flags give the defaults; each flag sets its field; bools get --x / --no-x."""
    assert parse() == Sample()
    assert parse("--size", "9", "--mode", "b", "--ratio", "2", "--verbose", "--limit", "3") == (
        Sample(size=9, mode="b", ratio=2.0, verbose=True, limit=3)
    )
    assert parse("--no-verbose").verbose is False
    assert parse("--tags", "a", "--tags", "b").tags == ("a", "b")


def test_argparse_refuses_choices_types_and_exclusive_pairs() -> None:
    """A value outside the choices, an unconvertible value or two exclusive flags exit 2."""
    for argv in (["--mode", "c"], ["--size", "x"], ["--limit", "2", "--budget", "2"]):
        with pytest.raises(SystemExit) as exited:
            parse(*argv)
        assert exited.value.code == 2


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"size": 0}, "size (--size) must be positive, got 0"),
        ({"size": True}, "size (--size) must be of type int, got True"),
        ({"size": "4"}, "size (--size) must be of type int, got '4'"),
        ({"mode": "c"}, "mode (--mode) must be one of a, b, got 'c'"),
        ({"ratio": "x"}, "ratio (--ratio) must be of type float, got 'x'"),
        ({"verbose": 1}, "verbose (--verbose) must be of type bool, got 1"),
        ({"limit": 1}, "limit (--limit) must be >= 2"),
        ({"mode": None}, "mode (--mode) must be set"),
        ({"limit": 2, "budget": 3}, "limit (--limit) and budget (--budget) cannot both be set"),
    ],
)
def test_validate_names_the_field_and_flag(kwargs: dict[str, object], message: str) -> None:
    """Every problem is an InvalidConfigError naming the field, its flag and the reason."""
    with pytest.raises(InvalidConfigError) as refused:
        validate(Sample(**kwargs))  # type: ignore[arg-type]
    assert str(refused.value) == message


def test_valid_values_pass() -> None:
    """An int is a valid float; None is valid where the field allows it."""
    assert validate(Sample(ratio=1, limit=None, budget=5)) is None
