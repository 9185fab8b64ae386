"""Packages are found from the tree, never listed by hand: a folder with an `__init__.py` under
one of kvtrace's rooms is the package `kvtrace.<room>.<...>` (a folder of data files a namespace
package that carries them), so a new subpackage cannot be left out of the wheel. Everything else
about the distribution is in pyproject.toml."""

from pathlib import Path

from setuptools import Extension, setup

# The top-level folders that make up the `kvtrace` namespace (tests, benchmarks and scripts
# stay out of the wheel).
ROOMS = ("schema", "store", "instrumentation", "collector", "analysis", "dashboards", "cli")

here = Path(__file__).parent


def _packages(room: Path) -> list[str]:
    """The room's packages: its folders with an `__init__.py`, and its data folders (files other
    than Python's), which travel as namespace packages with the files package-data names."""
    found = []
    for folder in (room, *(d for d in room.rglob("*") if d.is_dir() and d.name != "__pycache__")):
        files = [f for f in folder.iterdir() if f.is_file()]
        if (folder / "__init__.py").exists() or any(f.suffix not in (".py", ".pyc") for f in files):
            found.append("kvtrace." + ".".join(folder.relative_to(here).parts))
    return found


packages = sorted(p for room in ROOMS for p in _packages(here / room))
# kvtrace.<room> lives in ./<room>: the mapping of the namespace onto the repository root.
# The compiled cache state (analysis/native_state.py says why). Optional: where no C compiler is
# found the install goes on, and the reconstructor uses the Python state, slower, same rows.
native = Extension("kvtrace.analysis._native", ["analysis/_native.c"], optional=True,
                   extra_compile_args=["-O2", "-std=c11"])
setup(packages=packages, package_dir={"kvtrace": "."}, ext_modules=[native])
