"""`kvtrace verify`: prove a sample of verdicts by re-executing their prompts on a real engine.

Run it from the engine's environment (vLLM today). It starts the engine in-process on the
model with kvtrace's plugin on, serves the prompts once (the traffic whose verdicts are
checked), reconstructs their verdicts, picks up to N requests of each class (unsafe reuse,
cross-tenant, identity mismatch, PARTIAL, HIT, MISS), and for each sends the prompt again
(cached, traced: its own verdict is the one judged) and once with the prefix cache bypassed.
The noise floor comes from cache-free runs of the same prompts. Rows go to the store's
`verifications` table next to the events; the exit status is 1 when any reuse diverged.

Prompts are token ids: a JSONL file with one `{"prompt_token_ids": [...]}` per line, or a
request trace whose tokens are synthesized from its hash ids (as `kvtrace replay` does).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
import uuid
from argparse import Namespace
from collections import Counter
from pathlib import Path
from typing import Any


class PromptError(ValueError):
    """A prompts file that cannot be read; the message names the line."""


def read_prompts(path: str) -> list[list[int]]:
    prompts = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                ids = row["prompt_token_ids"] if isinstance(row, dict) else row
                if not ids or not all(isinstance(t, int) and t >= 0 for t in ids):
                    raise ValueError("expected a non-empty list of non-negative token ids")
            except (ValueError, KeyError, TypeError) as exc:
                raise PromptError(f"{path}:{n}: {exc}") from None
            prompts.append(list(ids))
    if not prompts:
        raise PromptError(f"{path}: no prompts")
    return prompts


def _prompts(args: Namespace, limit_tokens: int) -> list[list[int]]:
    if args.prompts:
        prompts = read_prompts(args.prompts)
    else:
        from kvtrace.instrumentation.replay import tokens_of
        from kvtrace.instrumentation.traces import read_trace

        prompts = [tokens_of(r) for r in read_trace(args.trace, limit=args.limit)]
    return [p[:limit_tokens] for p in prompts]


def run_verify(args: Namespace) -> int:
    if args.max_model_len <= args.n_gen:
        print(f"error: --max-model-len ({args.max_model_len}) must exceed --n-gen ({args.n_gen})", file=sys.stderr)
        return 2
    try:
        prompts = _prompts(args, args.max_model_len - args.n_gen)
        if not all(prompts):
            raise PromptError(f"{args.trace or args.prompts}: a prompt has no tokens")
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        from vllm import LLM

        from kvtrace.instrumentation.vllm.recipe import recipe_from_kv_cache_config
    except ImportError as exc:
        print(f"error: kvtrace verify needs vLLM in this environment ({exc}); "
              "build it with `bash scripts/engine-venv.sh vllm` and run .venvs/vllm/bin/kvtrace", file=sys.stderr)
        return 2
    # The engine runs in this process with kvtrace's plugin on, writing to a scratch spool.
    scratch = Path(tempfile.mkdtemp(prefix="kvtrace-verify-"))
    os.environ.update({"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "KVTRACE_ENABLED": "1", "KVTRACE_SINK": "spool",
                       "KVTRACE_SPOOL_DIR": str(scratch / "spool"), "KVTRACE_INSTANCE": args.instance})
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

    try:
        llm = LLM(model=args.model, skip_tokenizer_init=True, enable_prefix_caching=True, enforce_eager=True,
                  block_size=args.block_size, max_model_len=args.max_model_len, max_logprobs=max(args.top_k, 20))
    except Exception as exc:  # noqa: BLE001 - a model vLLM cannot load: say so, exit 2 (not "diverged")
        print(f"error: vLLM could not start on {args.model}: {exc}", file=sys.stderr)
        return 2
    config = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.kv_cache_config
    recipe = recipe_from_kv_cache_config(config)
    vocab = int(llm.llm_engine.model_config.get_vocab_size())
    if args.trace:  # synthesized ids: fold them into this model's vocabulary (shared prefixes stay shared)
        prompts = [[t % vocab for t in p] for p in prompts]
    bad = next((i for i, p in enumerate(prompts, 1) if max(p) >= vocab), 0)
    if bad:
        print(f"error: {args.prompts}:{bad}: token id {max(prompts[bad - 1])} is outside the model's vocabulary "
              f"({vocab})", file=sys.stderr)
        return 2
    try:
        return _verify(args, llm, recipe, prompts, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _verify(args: Namespace, llm: Any, recipe: Any, prompts: list[list[int]], scratch: Path) -> int:
    from kvtrace.analysis.oracle import engine_request, sample_by_class, verification
    from kvtrace.analysis.reconstruct import reconstruct
    from kvtrace.instrumentation.api import get_emitter
    from kvtrace.instrumentation.vllm.verify import VERIFY_SALT, noise_pairs, serve_prompt, verify_prompts
    from kvtrace.schema.arrow import to_arrow
    from kvtrace.schema.clickhouse import VERIFICATIONS
    from kvtrace.schema.divergence import noise_floor
    from kvtrace.schema.verdicts import Agreement, Verification
    from kvtrace.store.client import Store
    from kvtrace.store.ingest import iter_file_events

    def events() -> list:
        get_emitter().force_flush(timeout_millis=60_000)
        spool = scratch / "spool"
        return sorted((e for f in sorted(spool.iterdir()) for e in iter_file_events(f)),
                      key=lambda e: (e.ts_ns, e.source_id, e.seq)) if spool.exists() else []

    served = {}
    for prompt in prompts:  # the traffic whose verdicts are checked
        served[str(serve_prompt(llm, prompt, args.n_gen).request_id)] = prompt
    first = list(reconstruct(events(), recipe))
    by_id = {}
    for r in sample_by_class([r for r in first if r.tenant != VERIFY_SALT], args.per_class):
        rid = next((i for i in served if r.request_id == i or r.request_id.startswith(f"{i}-")), None)
        if rid is not None:
            by_id[rid] = served[rid]
    picked = list(by_id.values())
    started = time.perf_counter()
    pairs = verify_prompts(llm, picked, n_gen=args.n_gen, k=args.top_k)
    floor = noise_floor(noise_pairs(llm, picked[: args.noise_prompts], n_gen=args.n_gen, k=args.top_k))
    seconds = time.perf_counter() - started
    stored = events()
    results = list(reconstruct(stored, recipe))
    run_id = uuid.uuid4().hex[:12]
    rows: list[Verification] = []
    for pair in pairs:
        result = engine_request(results, pair.request_id)
        if result is not None:
            rows.append(verification(result, pair.cached, pair.fresh, floor, run_id, result.ts_ns,
                                     factor=args.floor_factor, atol=args.atol))
    if not args.no_store:
        with Store(args.dsn) as store:
            store.init()
            store.insert_events(stored)
            store.insert_arrow(VERIFICATIONS.name, to_arrow(rows, Verification))
    if not rows:
        print("error: no request could be verified (their verdicts were not found in the events)", file=sys.stderr)
        return 2
    counts = Counter(r.agreement for r in rows)
    print(f"verified {len(rows)} of {len(prompts)} requests (run {run_id}, {seconds:.1f} s): noise floor "
          f"{floor:.3g}; " + ", ".join(f"{a.value} {counts[a]}" for a in Agreement if counts[a]))
    for r in rows:
        print(f"  {r.request_id:<16} {r.verdict.value:<7} adopted {r.adopted_tokens:>6}  "
              f"{r.agreement.value:<22} {r.detail}")
    bad = counts[Agreement.DIVERGED] + counts[Agreement.ALARM_CONFIRMED]
    return 1 if bad else 0
