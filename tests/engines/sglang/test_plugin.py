"""The SGLang plugin: found through SGLang's own plugin loader, hooks applied by its registry.

A real SGLang engine does not start on this CPU-only machine (its memory pool needs a CPU
kernel build that is not on PyPI), so the scheduler side is exercised through the same hooks
SGLang applies: the registry patches `create_tree_cache` and `prepare_for_extend`, and the
patched functions are called here with SGLang's own cache and request classes.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from types import SimpleNamespace

from kvtrace.instrumentation.api import set_emitter
from kvtrace.instrumentation.attach import distribution_version
from kvtrace.instrumentation.emitter import BatchConfig, BatchEmitter
from kvtrace.instrumentation.sglang import plugin
from kvtrace.instrumentation.sglang.driver import DriverConfig, Mix, build_cache
from kvtrace.instrumentation.sinks.memory import MemorySink
from kvtrace.schema import EventKind
from kvtrace.schema.kinds import Tier


def test_sglang_loads_the_plugin_and_applies_its_hooks(tmp_path) -> None:  # noqa: ANN001
    """In a fresh process, as an SGLang process starts: load_plugins() finds kvtrace's entry
    point, which registers its hooks, and the registry patches the targets."""
    script = textwrap.dedent("""
        from kvtrace.instrumentation.sglang.cpu import install_vision_stand_in
        install_vision_stand_in()
        from sglang.srt.plugins import load_plugins
        from sglang.srt.plugins.hook_registry import HookRegistry
        load_plugins()
        import sglang.srt.mem_cache.registry as registry
        import sglang.srt.managers.schedule_batch as sb
        print(sorted(HookRegistry._hooks))
        print(registry.create_tree_cache.__name__, sb.ScheduleBatch.prepare_for_extend.__qualname__)
    """)
    env = {"KVTRACE_ENABLED": "1", "KVTRACE_SINK": "spool", "KVTRACE_SPOOL_DIR": str(tmp_path),
           "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert plugin.CACHE_TARGET in out.stdout and plugin.ADMIT_TARGET in out.stdout
    off = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin"}, timeout=300)
    assert off.returncode == 0 and "create_tree_cache" not in off.stdout.splitlines()[0]
    # a wrong mode is named at start-up, and tracing stays off; the engine starts all the same
    wrong = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                           env={**env, "KVTRACE_SGLANG_MODE": "sideways"}, timeout=300)
    assert wrong.returncode == 0 and "create_tree_cache" not in wrong.stdout.splitlines()[0]
    assert "KVTRACE_SGLANG_MODE='sideways': expected one of process, inline" in wrong.stderr


def test_hooks_attach_to_the_built_cache_and_record_admissions(monkeypatch) -> None:  # noqa: ANN001
    """In-process (`KVTRACE_SGLANG_MODE=inline`): the shim on the scheduler thread, sending to
    the process's emitter."""
    from array import array

    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    monkeypatch.setenv("KVTRACE_SGLANG_MODE", "inline")
    sink = MemorySink()
    emitter = BatchEmitter(sink, BatchConfig(), register_atexit=False)
    previous = set_emitter(emitter)
    try:
        cache, _, _ = build_cache(DriverConfig(mix=Mix.FULL, page_size=4, kv_tokens=1024))
        args = SimpleNamespace(served_model_name="tiny-llama", model_path="/models/tiny", revision="r7",
                               kv_cache_dtype="bfloat16")
        other_rank = SimpleNamespace(server_args=args, tp_rank=1, tp_size=2)
        assert plugin.after_create_tree_cache(cache, other_rank) is None
        assert not hasattr(cache, "_kvtrace_shim")  # TP mirrors are not instrumented twice
        dp_args = SimpleNamespace(enable_dp_attention=True, dp_size=2)  # two replicas of one rank each
        assert plugin.first_rank_of_replica(SimpleNamespace(server_args=dp_args, tp_rank=1, tp_size=2))
        model_config = SimpleNamespace(context_len=8192)  # what SGLang settled the context length on
        ctx = SimpleNamespace(server_args=args, model_config=model_config, tp_rank=0, tp_size=2)
        assert plugin.after_create_tree_cache(cache, ctx) is None
        shim = cache._kvtrace_shim
        assert shim.identity.model == "tiny-llama" and shim.identity.model_revision == "r7"

        req = Req(rid="q1", origin_input_text="", origin_input_ids=array("q", range(40)),
                  sampling_params=SamplingParams(max_new_tokens=1))
        req.cached_tokens_device, req.cached_tokens_host, req.cached_tokens_storage = 16, 8, 4
        batch = SimpleNamespace(tree_cache=cache, reqs=[req])
        plugin.after_prepare_for_extend(None, batch)
        plugin.after_prepare_for_extend(None, batch)  # the next chunk of the same request: no second adopt
        req.output_ids.extend([7, 8, 9])  # decoded, then retracted: admitted again, matched on 43 tokens
        req.reset_for_retract()
        req.prefix_len = 32  # its new match; SGLang leaves cached_tokens_* as the first admission set them
        plugin.after_prepare_for_extend(None, batch)
        plugin.after_prepare_for_extend(None, batch)
        assert emitter.force_flush()
    finally:
        set_emitter(previous)
        emitter.shutdown()
    attach = sink.events[0]  # what the engine is, once, before anything else
    assert attach.kind is EventKind.ATTACH and [e.kind for e in sink.events].count(EventKind.ATTACH) == 1
    assert (attach.model, attach.model_revision, attach.max_model_len) == ("tiny-llama", "r7", 8192)
    assert attach.engine_version == distribution_version("sglang") != ""
    adopts = [e for e in sink.events if e.kind is EventKind.ADOPT]
    assert len(adopts) == 2
    assert list(zip(adopts[1].reused_tiers, adopts[1].reused_tokens, strict=True)) == [(Tier.DEVICE, 32)]
    assert adopts[1].recomputed_tokens == 43 - 32
    a = adopts[0]
    assert a.engine == "sglang" and a.model == "tiny-llama" and a.request_id == "q1"
    assert list(zip(a.reused_tiers, a.reused_tokens, strict=True)) == [(Tier.DEVICE, 16), (Tier.HOST, 8),
                                                                       (Tier.DISK, 4)]
    assert a.recomputed_tokens == 12


def test_process_mode_attaches_a_resolver_and_falls_back_where_it_cannot(tmp_path, monkeypatch, caplog) -> None:  # noqa: ANN001
    """By default (`KVTRACE_SGLANG_MODE` unset: `process`) the plugin starts a resolver for a
    cache the mode covers (admissions reach the sink from there) and keeps the in-process shim,
    saying why, for one it does not (an older single-component tree)."""
    from array import array

    import msgspec
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    from kvtrace.instrumentation.sglang.capture import ProcessShim
    from kvtrace.instrumentation.sglang.shim import RadixCacheShim
    from kvtrace.schema.events import Event
    from kvtrace.schema.wire import SPOOL_SUFFIX, decode_batch, read_spool

    for name, value in {"KVTRACE_SINK": "spool", "KVTRACE_SPOOL_DIR": str(tmp_path), "KVTRACE_ENABLED": "1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("KVTRACE_SGLANG_MODE", raising=False)
    args = SimpleNamespace(served_model_name="tiny-llama", model_path="/models/tiny")
    cache, _, _ = build_cache(DriverConfig(mix=Mix.FULL, page_size=4, kv_tokens=1024))
    model_config = SimpleNamespace(context_len=4096)
    process = plugin.attach(cache, SimpleNamespace(server_args=args, model_config=model_config, tp_rank=0, tp_size=1))
    try:
        assert isinstance(process, ProcessShim) and cache._kvtrace_shim is process
        req = Req(rid="q1", origin_input_text="", origin_input_ids=array("q", range(40)),
                  sampling_params=SamplingParams(max_new_tokens=1))
        req.cached_tokens_device, req.cached_tokens_host, req.cached_tokens_storage = 16, 0, 0
        plugin.after_prepare_for_extend(None, SimpleNamespace(tree_cache=cache, reqs=[req]))
        assert process.flush(60)
    finally:
        process.close()
    events = []
    for path in tmp_path.glob(f"*{SPOOL_SUFFIX}"):
        with path.open("rb") as f:
            for payload in read_spool(f, path.name).payloads:
                events += [msgspec.msgpack.decode(raw, type=Event) for raw in decode_batch(payload).events]
    (attach,) = [e for e in events if e.kind is EventKind.ATTACH]  # the resolver's, with what the engine side read
    assert (attach.model, attach.max_model_len, attach.engine_version) == ("tiny-llama", 4096,
                                                                           distribution_version("sglang"))
    (adopt,) = [e for e in events if e.kind is EventKind.ADOPT]
    assert adopt.request_id == "q1" and adopt.model == "tiny-llama" and adopt.recomputed_tokens == 24

    older, _, _ = build_cache(DriverConfig(page_size=4, kv_tokens=1024, tree="pure_swa"))
    with caplog.at_level("WARNING", logger="kvtrace.sglang"):
        shim = plugin.attach(older, SimpleNamespace(server_args=args, tp_rank=0, tp_size=1))
    try:
        assert isinstance(shim, RadixCacheShim)
        assert "PureSWARadixCache" in caplog.text
    finally:
        shim.uninstall()
        from kvtrace.instrumentation.api import get_emitter

        get_emitter().shutdown()
        set_emitter(None)
