"""Packages are found from the tree, never listed by hand: a folder with an `__init__.py` under
one of kvtrace's rooms is the package `kvtrace.<room>.<...>`, so a new subpackage cannot be left
out of the wheel. Everything else about the distribution is in pyproject.toml."""

from pathlib import Path

from setuptools import setup

# The top-level folders that make up the `kvtrace` namespace (tests, benchmarks and scripts
# stay out of the wheel).
ROOMS = ("schema", "store", "instrumentation", "collector", "analysis", "dashboards", "cli")

here = Path(__file__).parent
packages = sorted(
    "kvtrace." + ".".join(init.parent.relative_to(here).parts)
    for room in ROOMS
    for init in (here / room).rglob("__init__.py")
    if "__pycache__" not in init.parts
)
# kvtrace.<room> lives in ./<room>: the mapping of the namespace onto the repository root.
setup(packages=packages, package_dir={"kvtrace": "."})
