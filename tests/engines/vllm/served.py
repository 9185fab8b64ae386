"""What the tests that run vLLM's OpenAI server share: child processes stopped as operators stop
them, the `kvtrace` command, `/metrics` counters, Chromium's DOM, and a tiny model with real
random weights, a tokenizer and LoRA adapters, all made here (nothing can be downloaded)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128, "intermediate_size": 256,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 2048,
    "max_position_embeddings": 4096, "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
}
LORA_TARGETS = ("q_proj", "v_proj")
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


class Proc:
    """A child process in its own process group, its output in a log file; `stop()` sends
    SIGTERM and waits, then SIGKILLs the group (vLLM's engine core and worker with it)."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], root: Path) -> None:
        self.name = name
        self.log_path = root / f"{name}.log"
        self._log = self.log_path.open("ab")
        self.proc = subprocess.Popen(argv, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_until(self, ready: Callable[[], bool], timeout_s: float, what: str | Callable[[], str]) -> None:
        """Poll `ready` while this process lives; fail naming `what` (a string, or a function that
        says what was reached so far) and showing the end of the process's log."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if ready():
                    return
            except httpx.HTTPError:
                pass
            if not self.alive() or time.monotonic() > deadline:
                said = what() if callable(what) else what
                ended = f"exited ({self.proc.returncode})" if not self.alive() else f"timed out after {timeout_s} s"
                raise AssertionError(f"{self.name} {ended} waiting for {said}:\n{self.tail()}")
            time.sleep(0.25)

    def stop(self, timeout_s: float = 60) -> int | None:
        """SIGTERM, as an operator stops a service; SIGKILL to the whole group after the timeout."""
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # whatever of the group outlived its leader
        except ProcessLookupError:
            pass
        if self.alive():
            self.proc.wait(30)
        self._log.close()
        return self.proc.returncode


def start_collector(root: Path, dsn: str, env: dict[str, str], tokens: Path) -> tuple[Proc, str]:
    """`kvtrace collector` over `dsn` with the bearer tokens in `tokens`, once it is ready; and its URL."""
    from collector_proc import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    collector = Proc("collector", [sys.executable, "-m", "kvtrace.cli.main", "--dsn", dsn, "collector", "--port",
                                   str(port), "--tokens-file", str(tokens)], env, root)
    try:
        collector.wait_until(lambda: httpx.get(f"{url}/readyz", timeout=2).status_code == 200, 120, "readiness")
    except BaseException:
        collector.stop(timeout_s=30)
        raise
    return collector, url


def kvtrace(env: dict[str, str], dsn: str, *argv: str, timeout_s: float = 300) -> subprocess.CompletedProcess[str]:
    """The `kvtrace` command in its own process, as an operator runs it."""
    return subprocess.run([sys.executable, "-m", "kvtrace.cli.main", "--dsn", dsn, *argv], env=env,
                          capture_output=True, text=True, timeout=timeout_s)


def metric(text: str, name: str) -> int:
    """A counter of vLLM's `/metrics`, summed over its label sets."""
    values = [float(v) for v in re.findall(rf"^{re.escape(name)}{{[^}}]*}} (\S+)$", text, re.MULTILINE)]
    assert values, f"/metrics has no {name}"
    return int(sum(values))


def chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    assert path, "headless Chromium is needed (Debian's `chromium`; scripts/test.sh installs it)"
    return path


def dump_dom(url: str) -> str:
    """The page as Chromium rendered it, once its charts are drawn; no console errors."""
    args = [chromium(), "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
            "--enable-logging=stderr", "--v=0", "--virtual-time-budget=15000", "--dump-dom", url]
    dom = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    console = [line for line in dom.stderr.splitlines() if "CONSOLE" in line]
    assert not [line for line in console if "rror" in line or "Uncaught" in line], console
    assert 'data-ready="1"' in dom.stdout, url
    return dom.stdout


# -- a model, its tokenizer and its adapters ----------------------------------------------------

def tiny_llama(path: Path, seed: int = 0) -> Path:
    """A 2-layer Llama with random weights large enough (initializer_range 0.2) that its greedy
    outputs depend on the KV it reads, and a word-level tokenizer with a chat template."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(seed)
    shape = {k: v for k, v in LLAMA.items() if k not in ("architectures", "model_type", "torch_dtype")}
    LlamaForCausalLM(LlamaConfig(**shape, initializer_range=0.2)).save_pretrained(path, safe_serialization=True)
    specials = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"]
    vocab = {w: i for i, w in enumerate(specials + [f"w{i}" for i in range(int(LLAMA["vocab_size"]) - len(specials))])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    return path


def lora_adapter(path: Path, seed: int, rank: int = 8) -> Path:
    """A PEFT LoRA adapter for `tiny_llama` (q and v projections of every layer), random weights
    from `seed`: written again with another seed, it is the same adapter with other weights."""
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    hidden, heads, kv_heads, head_dim = (int(LLAMA[k]) for k in ("hidden_size", "num_attention_heads",
                                                                  "num_key_value_heads", "head_dim"))
    out = {"q_proj": heads * head_dim, "v_proj": kv_heads * head_dim}
    tensors = {}
    for layer in range(int(LLAMA["num_hidden_layers"])):
        for target in LORA_TARGETS:
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{target}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, hidden, generator=gen) * 0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out[target], rank, generator=gen) * 0.5
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0,
        "target_modules": list(LORA_TARGETS), "bias": "none", "base_model_name_or_path": "tiny-llama"}))
    return path
