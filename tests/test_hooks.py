"""The fenced wrappers every engine shim hooks with: the engine's call always runs and returns
as it would, whatever the hook does, and a shim's `HookSet` puts back exactly what it wrapped."""

from __future__ import annotations

import logging

import pytest

from kvtrace.instrumentation.hooks import HookSet

log = logging.getLogger("test")


class Engine:
    def step(self, x: int) -> int:
        return x + 1


@pytest.mark.parametrize("wrap", ["wrap_after", "wrap_before"])
def test_a_failing_hook_is_counted_and_the_call_goes_on(wrap: str) -> None:
    engine, failed, seen = Engine(), [], []
    hooks = HookSet("Test", log, failed.append)

    def hook(*args: object) -> None:
        seen.append(args)
        raise RuntimeError("kvtrace bug")

    assert getattr(hooks, wrap)(engine, "step", hook)
    assert engine.step(41) == 42 and engine.step(1) == 2
    assert failed == ["step", "step"]
    # after: the result, then the arguments; before: the arguments alone
    assert seen == ([(42, 41), (2, 1)] if wrap == "wrap_after" else [(41,), (1,)])
    assert len(hooks) == 1
    hooks.restore()  # what a shim's uninstall does
    assert engine.step(1) == 2 and len(seen) == 2 and len(hooks) == 0
    assert "step" not in vars(engine)  # the class's method shows through again


@pytest.mark.parametrize("wrap", ["wrap_after", "wrap_before"])
def test_a_missing_method_leaves_the_hook_off(wrap: str, caplog: pytest.LogCaptureFixture) -> None:
    hooks = HookSet("Test", log, lambda name: None)
    assert not getattr(hooks, wrap)(Engine(), "gone", lambda *a: None)
    assert len(hooks) == 0 and "Test's Engine has no gone" in caplog.text


def test_restore_undoes_the_last_wrap_first_and_only_once() -> None:
    """Two hooks on one method, a hand-written wrapper on an attribute the object holds itself:
    restored in reverse order, each put back as it was; a second restore does nothing."""
    engine, order = Engine(), []
    own = engine.own = lambda: "own"  # type: ignore[attr-defined]
    hooks = HookSet("Test", log, lambda name: None)
    hooks.wrap_after(engine, "step", lambda result, x: order.append(("first", x)))
    hooks.wrap_before(engine, "step", lambda x: order.append(("second", x)))
    hooks.replace(engine, "own", lambda: "wrapped")
    assert engine.step(1) == 2 and order == [("second", 1), ("first", 1)]
    assert engine.own() == "wrapped"  # type: ignore[attr-defined]
    hooks.restore()
    assert engine.step(2) == 3 and len(order) == 2
    assert engine.own is own and "step" not in vars(engine)  # type: ignore[attr-defined]
    engine.step = lambda x: 0  # type: ignore[method-assign]  # set after the restore: left alone
    hooks.restore()
    assert engine.step(5) == 0
