"""Argument types the command groups share: times, counts, integer lists, the recipe option's
form. Standard library only: the top parser is built from these without loading anything else."""

from __future__ import annotations

import argparse
from datetime import datetime, timezone

RECIPE_METAVAR = "[[ENGINE:]MODEL=]RECIPE"


def time_ns(text: str) -> int:
    """ISO-8601 time (UTC if no zone) or integer nanoseconds since the epoch."""
    if text.isdigit():
        return int(text)
    try:
        dt = datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither ISO-8601 time nor integer ns") from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return int(dt.timestamp() * 1e9)


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None


def non_negative(text: str) -> int:
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def positive(text: str) -> int:
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def int_list(text: str, name: str) -> list[int]:
    """Comma-separated non-negative integers; `name` is the option the error names."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{name}: expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 0:
        raise ValueError(f"{name}: expected non-negative integers, got {text!r}")
    return values


RECIPE_HELP = ("override the recipe each engine published when it attached: a built-in recipe name or a "
               ".json/.toml file; MODEL= (or ENGINE:MODEL=) scopes it to one model, an unscoped one serves every "
               "model (repeatable). A recipe the events contradict is refused")


def add_recipe_option(parser: argparse.ArgumentParser, help: str = RECIPE_HELP) -> None:
    """`--recipe`, optional everywhere: with none, lookups are judged by their engine's own recipe."""
    parser.add_argument("--recipe", action="append", default=[], metavar=RECIPE_METAVAR, help=help)
