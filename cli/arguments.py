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


def gib(text: str) -> float:
    """A size in GiB, the unit every size the CLI takes or prints is in; fractions allowed."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid size in GiB: {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"a size in GiB must be >= 0, got {text}")
    return value


def gib_bytes(text: str) -> int:
    """A positive size given in GiB, as bytes."""
    size = int(gib(text) * 2**30)
    if size < 1:
        raise argparse.ArgumentTypeError(f"a size in GiB must be > 0, got {text}")
    return size


def mib_bytes(text: str) -> int:
    """The MiB spelling some options had before sizes were all GiB, still read, as bytes."""
    return positive(text) << 20


def gib_text(size_bytes: float) -> str:
    """Bytes as the CLI prints sizes: GiB, with three decimals (1 MiB shows as 0.001 GiB)."""
    return f"{size_bytes / 2**30:.3f} GiB"


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
