"""Progress bars on stderr for long replays, when tqdm is installed (it comes with kvtrace's
`all` extra); without it the same commands run silently instead of refusing to run."""

from __future__ import annotations

import sys
from typing import Any


class _Silent:
    """What `bar` gives when tqdm is missing: the part of tqdm's interface the commands use."""

    def __enter__(self) -> _Silent:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def update(self, n: int = 1) -> None:
        return None


def bar(**kwargs: Any) -> Any:
    """A tqdm bar on stderr with these options (`total`, `desc`, `unit`, ...), or a silent one."""
    try:
        from tqdm import tqdm
    except ModuleNotFoundError:
        return _Silent()
    return tqdm(file=sys.stderr, **kwargs)
