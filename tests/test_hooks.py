"""The fenced wrappers every engine shim hooks with: the engine's call always runs and returns
as it would, whatever the hook does, and a shim's `HookSet` puts back exactly what it wrapped."""

from __future__ import annotations

import inspect
import logging
import typing

import msgspec
import pytest
from transparency import face_differences, unfaithful

from kvtrace.instrumentation.hooks import HookSet, class_patches, patch_class, transparent

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


# -- wrappers wear the original's face ----------------------------------------------------------

class Adapter(msgspec.Struct, array_like=True):  # as vLLM's LoRARequest
    name: str
    rank: int


class Core:
    """A method an engine calls by name with decoded arguments, as vLLM's engine core does."""

    def add_lora(self, lora_request: Adapter, retries: int = 0) -> bool:
        """Load an adapter."""
        return isinstance(lora_request, Adapter)

    @classmethod
    def probe(cls, keys: list[int], group: int = 0) -> int:
        return len(keys) + group


def utility_call(obj: object, name: str, *args: object) -> object:
    """What vLLM's `EngineCore` does with a utility call's msgpack arguments: each is converted to
    the struct its parameter's annotation names, read from the method's signature (evaluated:
    this module's annotations are strings, vLLM's engine core's are not)."""
    method = getattr(obj, name)
    params = inspect.signature(method, eval_str=True).parameters.values()
    return method(*(msgspec.convert(v, type=p.annotation)
                    if inspect.isclass(p.annotation) and issubclass(p.annotation, msgspec.Struct) else v
                    for v, p in zip(args, params, strict=False)))


def assert_same_face(original: object, wrapped: object) -> None:
    assert face_differences(original, wrapped) == []
    assert str(inspect.signature(wrapped)) == str(inspect.signature(original))
    assert typing.get_type_hints(wrapped) == typing.get_type_hints(original)


@pytest.mark.parametrize("wrap", ["wrap_after", "wrap_before", "replace"])
def test_an_instance_wrapper_keeps_the_methods_signature_annotations_and_name(wrap: str) -> None:
    core, seen = Core(), []
    before = core.add_lora
    hooks = HookSet("Test", log, lambda name: None)
    if wrap == "replace":
        hooks.replace(core, "add_lora", lambda *a, **k: seen.append(a) or before(*a, **k))
    else:
        getattr(hooks, wrap)(core, "add_lora", lambda *a, **k: seen.append(a))
    assert core.add_lora is not before and seen == []
    assert_same_face(before, core.add_lora)
    assert hooks.wrapped() == [(core, "add_lora", before)] and unfaithful(hooks.wrapped()) == {}
    # the engine's argument conversion still finds the struct: the adapter arrives as one
    assert utility_call(core, "add_lora", ["sql", 8]) is True and seen


def test_a_class_patch_keeps_the_face_of_methods_and_classmethods() -> None:
    class Engine(Core):
        add_lora = Core.add_lora
        probe = Core.__dict__["probe"]

    before, probe_before = Engine.add_lora, Engine.probe
    calls = []

    def counting(original):  # noqa: ANN001, ANN202
        def wrapper(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            calls.append(original.__name__)
            return original(*args, **kwargs)

        return wrapper

    assert patch_class(Engine, "add_lora", counting) and patch_class(Engine, "probe", counting)
    assert not patch_class(Engine, "gone", counting)
    assert_same_face(before, Engine.add_lora)
    assert_same_face(probe_before, Engine.probe)
    assert isinstance(vars(Engine)["probe"], classmethod)
    assert utility_call(Engine(), "add_lora", ["sql", 8]) is True
    assert Engine.probe([1, 2], group=1) == 3 and calls == ["add_lora", "probe"]
    assert [(cls, name) for cls, name, _ in class_patches()][-2:] == [(Engine, "add_lora"), (Engine, "probe")]
    assert unfaithful(class_patches()[-2:]) == {}


def test_the_check_names_a_wrapper_that_hides_its_original() -> None:
    core = Core()
    original = core.add_lora
    core.add_lora = lambda *a, **k: original(*a, **k)  # type: ignore[method-assign]
    (diffs,) = unfaithful([(core, "add_lora", original)]).values()
    assert diffs[0] == "signature (*a, **k) instead of (lora_request: 'Adapter', retries: 'int' = 0) -> 'bool'"
    assert "__name__ '<lambda>' instead of 'add_lora'" in diffs


def test_a_bare_wrapper_would_have_broken_the_engines_conversion() -> None:
    """Why: the same call through a `*args, **kwargs` wrapper hands the engine a raw list (the
    `'list' object has no attribute 'lora_int_id'` that killed vLLM's engine core)."""
    core = Core()
    original = core.add_lora
    core.add_lora = lambda *a, **k: original(*a, **k)  # type: ignore[method-assign]
    assert utility_call(core, "add_lora", ["sql", 8]) is False


def test_a_wrapper_of_an_abstract_method_is_not_abstract() -> None:
    """A connector's forwarding method wears the abstract base method's face, and its class can
    still be built."""
    import abc

    class Base(abc.ABC):
        @abc.abstractmethod
        def start(self, n: int) -> int:
            """Start."""

    class Forwarding(Base):
        pass

    Forwarding.start = transparent(Base.start, lambda self, n: n + 1)  # type: ignore[method-assign]
    abc.update_abstractmethods(Forwarding)
    assert Forwarding().start(1) == 2 and face_differences(Base.start, Forwarding.start) == []
