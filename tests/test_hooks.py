"""The fenced wrappers every engine shim hooks with: the engine's call always runs and returns
as it would, whatever the hook does."""

from __future__ import annotations

import logging

import pytest

from kvtrace.instrumentation.hooks import wrap_after, wrap_before

log = logging.getLogger("test")


class Engine:
    def step(self, x: int) -> int:
        return x + 1


@pytest.mark.parametrize("wrap", [wrap_after, wrap_before])
def test_a_failing_hook_is_counted_and_the_call_goes_on(wrap) -> None:  # noqa: ANN001
    engine, failed, saved, seen = Engine(), [], [], []

    def hook(*args: object) -> None:
        seen.append(args)
        raise RuntimeError("kvtrace bug")

    assert wrap(engine, "step", hook, failed.append, saved, log, "Test")
    assert engine.step(41) == 42 and engine.step(1) == 2
    assert failed == ["step", "step"]
    # after: the result, then the arguments; before: the arguments alone
    assert seen == ([(42, 41), (2, 1)] if wrap is wrap_after else [(41,), (1,)])
    (obj, name, original), = saved
    setattr(obj, name, original)  # what a shim's uninstall does
    assert engine.step(1) == 2 and len(seen) == 2


@pytest.mark.parametrize("wrap", [wrap_after, wrap_before])
def test_a_missing_method_leaves_the_hook_off(wrap, caplog: pytest.LogCaptureFixture) -> None:  # noqa: ANN001
    saved: list = []
    assert not wrap(Engine(), "gone", lambda *a: None, lambda name: None, saved, log, "Test")
    assert saved == [] and "has no gone" in caplog.text
