"""kvpage's architectures against llama.cpp on the same GGUF files (issue #43).

Local verification, not a CI test: it needs a llama.cpp source tree (for
``convert_hf_to_gguf.py``, its ``conversion/`` package and ``gguf-py``) and a built
``llama-server``.

    python benches/llama_cpp_agreement.py [--archs gemma2,qwen3_moe] [--outtypes f32,q8_0]

For each architecture:

1. a tiny random HF checkpoint (``tests/model_fixtures.py``'s ``build_hf_model``,
   with a real tokenizer the converter accepts: SmolLM2's byte-level BPE, rebuilt from
   ``/work/models/SmolLM2-135M-Instruct.Q4_1.gguf`` through transformers' GGUF reader,
   whose pre-tokenizer hash llama.cpp knows as ``smollm``; Qwen2 gets Qwen2.5's, hash
   ``qwen2``; Gemma 1/2, whose converter only reads sentencepiece, get a small
   sentencepiece BPE model trained here: ``pip install --target /tmp/lcpp-deps
   sentencepiece`` first);
2. ``convert_hf_to_gguf.py --outtype f32`` (and ``q8_0``);
3. greedy tokens for a few prompts (token ids) from kvpage (``load_gguf`` +
   ``paged_greedy``), transformers (on the HF checkpoint) and ``llama-server``
   (``/completion`` with the prompt as token ids, temperature 0, f32 KV cache, no flash
   attention), free-running and teacher-forced on kvpage's tokens (``n_probs``);
4. one table: converter OK | kvpage vs transformers | kvpage vs llama-server, with the
   first divergence and the top-1/top-2 logit margins there, and what the converter
   wrote for the MoE models (expert keys and tensors).

Work files go under ``--workdir`` (default /tmp/llama_cpp_agreement).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

LLAMA_CPP = Path("/tmp/llama-cpp/src/llama.cpp")
SERVER = LLAMA_CPP / "build-noamx" / "bin" / "llama-server"
BPE_SOURCES = {
    "bpe": ("/work/models", "SmolLM2-135M-Instruct.Q4_1.gguf"),  # llama.cpp: "smollm"
    "qwen": ("/work/models", "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"),  # llama.cpp: "qwen2"
}
# sentencepiece for the converter (not in the project's venv): pip install --target here.
EXTRA_PYTHONPATH = "/tmp/lcpp-deps"

# name -> (fixture arch of tests/model_fixtures.py, config overrides, tokenizer kind).
# hidden 64, head_dim 16 (so Gemma's query_pre_attn_scalar = head_dim: llama.cpp scales
# queries by head_dim ** -0.5 whatever the HF config says, except the 27B sizes),
# windows of 8 tokens (< the prompts + 16 new tokens) for Gemma 2/3.
ARCHS: dict[str, tuple[str, dict[str, Any], str]] = {
    "llama": ("llama", {}, "bpe"),
    "mistral": ("mistral", {}, "bpe"),
    # transformers 5 loads a qwen2 checkpoint's tokenizer as Qwen2Tokenizer (Qwen's own
    # pre-tokenizer), so SmolLM2's vocabulary hashes to nothing llama.cpp knows: Qwen2
    # gets Qwen2.5's tokenizer.
    "qwen2": ("qwen2", {}, "qwen"),
    "qwen3": ("qwen3", {}, "bpe"),
    "qwen3_moe": ("qwen3_moe", dict(mlp_only_layers=[], num_hidden_layers=3), "bpe"),
    "qwen2_moe": ("qwen2_moe", dict(num_hidden_layers=3), "bpe"),
    "mixtral": ("mixtral", dict(num_hidden_layers=3), "bpe"),
    # llama.cpp's OLMoE wants q/k norms of width hidden: no GQA (as OLMoE-1B-7B).
    "olmoe": ("olmoe", dict(num_hidden_layers=3, num_key_value_heads=4), "bpe"),
    "gemma": ("gemma", {}, "spm"),
    "gemma2": ("gemma2", dict(query_pre_attn_scalar=16, sliding_window=8, num_hidden_layers=4,
                              layer_types=["sliding_attention", "full_attention"] * 2), "spm"),
    # llama.cpp's Gemma 3 without a pattern in the file: every 6th layer full.
    "gemma3": ("gemma3", dict(query_pre_attn_scalar=16, sliding_window=8, num_hidden_layers=6,
                              rope_local_base_freq=10000.0,
                              layer_types=["sliding_attention"] * 5 + ["full_attention"]),
               "bpe"),
    # The same with a local RoPE base other than Gemma 3's 10000: the converter writes
    # gemma3.rope.freq_base_swa, which llama.cpp reads.
    "gemma3_local_base_500": ("gemma3", dict(
        query_pre_attn_scalar=16, sliding_window=8, num_hidden_layers=6,
        rope_local_base_freq=500.0,
        layer_types=["sliding_attention"] * 5 + ["full_attention"]), "bpe"),
    # Gemma 3 4B+ scale the global layers' RoPE linearly (factor 8), not the local ones.
    "gemma3_rope_linear_8": ("gemma3", dict(
        query_pre_attn_scalar=16, sliding_window=8, num_hidden_layers=6,
        layer_types=["sliding_attention"] * 5 + ["full_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0,
                                            "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
        "bpe"),
    "phi3": ("phi3", {}, "bpe"),
    # Phi-3 with a window shorter than the text: llama.cpp disables Phi-3's SWA.
    "phi3_window_8": ("phi3", dict(sliding_window=8), "bpe"),
}


# --------------------------------------------------------------------------- tokenizers
def bpe_tokenizer(workdir: Path, kind: str = "bpe") -> Path:
    """SmolLM2's (or Qwen2.5's) tokenizer as HF files (from its GGUF), cached under
    ``workdir``."""
    out = workdir / f"tokenizer_{kind}"
    if not (out / "tokenizer.json").is_file():
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(BPE_SOURCES[kind][0], gguf_file=BPE_SOURCES[kind][1])
        tok.save_pretrained(out)
    return out


def spm_tokenizer(workdir: Path) -> Path:
    """A 1000-piece sentencepiece BPE model (byte fallback; pad 0, eos 1, bos 2, unk 3
    as Gemma's) trained on this repository's docs, cached under ``workdir``."""
    out = workdir / "tokenizer_spm"
    if not (out / "tokenizer.model").is_file():
        if EXTRA_PYTHONPATH not in sys.path:
            sys.path.append(EXTRA_PYTHONPATH)
        import sentencepiece as spm

        out.mkdir(parents=True, exist_ok=True)
        text = out / "corpus.txt"
        with text.open("w") as f:
            for path in sorted((ROOT / "docs").rglob("*.md")) + [ROOT / "README.md"]:
                f.write(path.read_text(errors="ignore"))
        spm.SentencePieceTrainer.train(
            input=str(text), model_prefix=str(out / "tokenizer"), vocab_size=1000,
            model_type="bpe", byte_fallback=True, pad_id=0, eos_id=1, bos_id=2, unk_id=3,
            character_coverage=1.0, minloglevel=2,
        )
    return out


def tokenizer_files(kind: str, workdir: Path, directory: Path, arch: str) -> int:
    """Copy the tokenizer of ``kind`` into the checkpoint ``directory``; its vocab size."""
    if kind == "spm":
        src = spm_tokenizer(workdir)
        shutil.copy(src / "tokenizer.model", directory / "tokenizer.model")
        if EXTRA_PYTHONPATH not in sys.path:
            sys.path.append(EXTRA_PYTHONPATH)
        import sentencepiece as spm

        return spm.SentencePieceProcessor(model_file=str(src / "tokenizer.model")).vocab_size()
    src = bpe_tokenizer(workdir, kind)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, directory / name)
    if arch == "phi3":  # Phi3MiniModel.set_vocab reads sentencepiece unless GPT2Tokenizer
        cfg_path = directory / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg["tokenizer_class"] = "GPT2Tokenizer"
        cfg_path.write_text(json.dumps(cfg, indent=1))
    tok = json.loads((src / "tokenizer.json").read_text())
    ids = list(tok["model"]["vocab"].values()) + [t["id"] for t in tok["added_tokens"]]
    return max(ids) + 1


# --------------------------------------------------------------------------- comparison
def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


@dataclass
class Greedy:
    """Free-running greedy tokens: prompts whose 16 tokens are equal, else the first
    divergence with the logit gaps there."""

    equal: int = 0
    total: int = 0
    notes: list[str] = field(default_factory=list)

    def add(self, prompt_index: int, ours: list[int], theirs: list[int],
            our_logits: np.ndarray | None = None) -> None:
        self.total += 1
        if ours == theirs:
            self.equal += 1
            return
        i = next((k for k, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b),
                 min(len(ours), len(theirs)))
        if i >= min(len(ours), len(theirs)):
            self.notes.append(f"p{prompt_index}: lengths {len(ours)} / {len(theirs)}")
            return
        note = f"p{prompt_index}: first divergence at new token {i} ({ours[i]} vs {theirs[i]})"
        if our_logits is not None:
            row = our_logits[i]
            note += f", first side's logit gap between them {row[ours[i]] - row[theirs[i]]:.3g}"
        self.notes.append(note)

    def cell(self) -> str:
        if self.total == 0:
            return "-"
        first = ""
        if self.equal < self.total:
            first = " (" + "; ".join(n.split(" (")[0].replace("first divergence at new token",
                                                               "diverges at")
                                     for n in self.notes) + ")"
        return f"{self.equal}/{self.total}{first}"


@dataclass
class Stepwise:
    """Teacher-forced on kvpage's greedy path: at every step, does the other side's
    argmax equal kvpage's token, and how far apart are the log-probabilities of the
    other side's top-5 tokens."""

    steps: int = 0
    agree: int = 0
    max_dlogp: float = 0.0
    no_probs: int = 0  # steps whose probabilities llama-server did not report
    notes: list[str] = field(default_factory=list)

    def add(self, prompt_index: int, step: int, our_logits: np.ndarray,
            their_top: list[tuple[int, float]] | None, their_gap: float | None = None,
            their_argmax: int | None = None) -> None:
        """``their_top``: the other side's top tokens with their log-probabilities, best
        first (None: only ``their_argmax`` is known); ``their_gap``: its
        logit(argmax) - logit(kvpage's token) if known."""
        ours = log_softmax(our_logits)
        mine = int(np.argmax(our_logits))
        self.steps += 1
        if their_top:
            self.max_dlogp = max(self.max_dlogp,
                                 max(abs(ours[t] - lp) for t, lp in their_top))
            other = their_top[0][0]
        else:
            self.no_probs += 1
            other = int(their_argmax)  # type: ignore[arg-type]
            their_top = [(other, float("nan"))]
        if other == mine:
            self.agree += 1
            return
        note = (f"p{prompt_index} step {step}: kvpage {mine} / other {other}; kvpage "
                f"logit gap {our_logits[mine] - our_logits[other]:.3g}")
        if their_gap is None:
            lp = dict(their_top)
            their_gap = (their_top[0][1] - lp[mine]) if mine in lp else None
        if their_gap is not None and not np.isnan(their_gap):
            note += f", other's gap {their_gap:.3g}"
        else:
            note += ", other's gap not reported" if np.isnan(their_top[0][1]) else \
                ", other's gap > its top-5"
        self.notes.append(note)

    def cell(self) -> str:
        if self.steps == 0:
            return "-"
        missing = f" ({self.no_probs} steps argmax only)" if self.no_probs else ""
        return f"{self.agree}/{self.steps}, {self.max_dlogp:.1e}{missing}"


# --------------------------------------------------------------------------- llama-server
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict[str, Any], timeout: float = 120) -> dict[str, Any]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


@contextlib.contextmanager
def llama_server(gguf_path: Path, log: Path) -> Any:
    port = free_port()
    libs = f"{SERVER.parent}:{os.environ.get('LD_LIBRARY_PATH', '')}"
    env = dict(os.environ, LD_LIBRARY_PATH=libs)
    # f32 KV cache and no flash attention: llama.cpp's CPU flash attention computes in
    # f16 whatever the cache type (|log-prob| differences 5e-3 instead of 1e-5 on f32).
    cmd = [str(SERVER), "-m", str(gguf_path), "--temp", "0", "-np", "1", "-c", "512",
           "-ctk", "f32", "-ctv", "f32", "-fa", "off", "-t", "2", "--host", "127.0.0.1",
           "--port", str(port)]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"llama-server exited {proc.returncode}; see {log}")
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            if time.time() > deadline:
                raise RuntimeError(f"llama-server not healthy after 120 s; see {log}")
            time.sleep(0.5)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def server_greedy(base: str, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens from llama-server for a prompt of token ids (no BOS is added)."""
    body = {"prompt": prompt, "n_predict": n, "temperature": 0, "top_k": 1,
            "cache_prompt": False, "return_tokens": True}
    res = post(base + "/completion", body)
    return list(res.get("tokens") or [])


def server_top(base: str, prompt: list[int], k: int = 5
               ) -> tuple[int, list[tuple[int, float]] | None]:
    """llama-server's next token after ``prompt`` and its top-``k`` tokens with their
    log-probabilities (``n_probs``: softmax of the raw logits), best first. The server
    reports no probabilities for a token that ends inside a UTF-8 character: None."""
    body = {"prompt": prompt, "n_predict": 1, "temperature": 0, "top_k": 1,
            "cache_prompt": False, "n_probs": k, "return_tokens": True}
    res = post(base + "/completion", body)
    probs = res.get("completion_probabilities") or []
    if not probs:
        return int(res["tokens"][0]), None
    top = [(int(t["id"]), float(t["logprob"])) for t in probs[0]["top_logprobs"]]
    return top[0][0], top


# --------------------------------------------------------------------------- GGUF facts
def gguf_facts(path: Path) -> dict[str, Any]:
    import gguf

    reader = gguf.GGUFReader(str(path))
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    keys = {}
    for name, f in reader.fields.items():
        if name.startswith(arch + ".") and ("expert" in name or "swa" in name
                                            or "sliding" in name or "rope" in name):
            try:
                value = f.contents()
            except Exception:  # noqa: BLE001
                value = "?"
            keys[name.removeprefix(arch + ".")] = value
    tensors = {}
    for t in reader.tensors:
        if t.name.startswith("blk.0."):
            tensors[t.name.removeprefix("blk.0.")] = (t.tensor_type.name,
                                                      [int(x) for x in t.shape])
    types = sorted({t.tensor_type.name for t in reader.tensors})
    return dict(arch=arch, keys=keys, blk0=tensors, types=types)


# --------------------------------------------------------------------------- main
def convert(directory: Path, outtype: str, out: Path, log: Path) -> bool:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (EXTRA_PYTHONPATH, env.get("PYTHONPATH", "")) if p)
    cmd = [sys.executable, str(LLAMA_CPP / "convert_hf_to_gguf.py"), str(directory),
           "--outtype", outtype, "--outfile", str(out)]
    with log.open("w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env).returncode
    return rc == 0 and out.is_file()


def prompts_for(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    low = 10 if vocab > 200 else 3
    return [rng.integers(low, vocab, n).tolist() for n in (5, 11, 20)]


def router_gap(model: Any, sequences: list[list[int]]) -> str:
    """MoE only: the smallest gap, over layers and positions of ``sequences`` run through
    the HF model, between the k-th and (k+1)-th router logits (a near tie there lets
    float rounding pick another expert)."""
    import torch

    gates = [(n, m) for n, m in model.named_modules() if n.endswith("mlp.gate")
             and getattr(m, "weight", None) is not None and m.weight.dim() == 2]
    k = getattr(model.config, "num_experts_per_tok", 0)
    if not gates or not k:
        return ""
    seen: list[tuple[float, str, int, int]] = []

    def hook(name: str) -> Any:
        def fn(module: Any, args: tuple, _out: Any) -> None:
            x = args[0].reshape(-1, args[0].shape[-1]).float()
            logits = x @ module.weight.float().T
            top = torch.topk(logits, k + 1, dim=-1).values
            gap = top[:, k - 1] - top[:, k]
            pos = int(torch.argmin(gap))
            seen.append((float(gap[pos]), name.split(".")[2], pos, current[0]))
        return fn

    current = [0]
    handles = [m.register_forward_hook(hook(n)) for n, m in gates]
    try:
        with torch.no_grad():
            for i, seq in enumerate(sequences):
                current[0] = i
                model(torch.tensor([seq]))
    finally:
        for h in handles:
            h.remove()
    gap, layer, pos, seq = min(seen)
    return f"smallest router top-{k} boundary gap {gap:.2e} (p{seq}, layer {layer}, position {pos})"


def run_arch(name: str, args: argparse.Namespace) -> dict[str, Any]:
    from kvpage.model.gguf_loader import load_gguf
    from model_fixtures import (
        build_hf_model,
        hf_greedy,
        hf_logits,
        paged_greedy,
        save_hf_model,
    )

    fixture, overrides, tok_kind = ARCHS[name]
    work = args.workdir / name
    if work.exists():
        shutil.rmtree(work)
    hf_dir = work / "hf"
    hf_dir.mkdir(parents=True)
    vocab = tokenizer_files(tok_kind, args.workdir, hf_dir, fixture)
    model = build_hf_model(fixture, seed=args.seed, vocab_size=vocab,
                           max_position_embeddings=2048, **overrides)
    save_hf_model(model, hf_dir)
    prompts = prompts_for(vocab, args.seed)
    n = args.new_tokens
    hf_tokens = [hf_greedy(model, p, n) for p in prompts]
    result: dict[str, Any] = dict(name=name, vocab=vocab, tokenizer=tok_kind, rows=[])
    for outtype in args.outtypes:
        row: dict[str, Any] = dict(outtype=outtype)
        result["rows"].append(row)
        path = work / f"{name}-{outtype}.gguf"
        t0 = time.time()
        row["converter_ok"] = convert(hf_dir, outtype, path, work / f"convert-{outtype}.log")
        row["convert_s"] = round(time.time() - t0, 1)
        if not row["converter_ok"]:
            lines = (work / f"convert-{outtype}.log").read_text().strip().splitlines()
            row["error"] = lines[-1] if lines else "?"
            continue
        row["facts"] = gguf_facts(path)
        try:
            config, params, _ = load_gguf(path, tokenizer=False)
            ours = [paged_greedy(config, params, p, n) for p in prompts]
        except Exception as exc:  # noqa: BLE001
            row["kvpage_error"] = f"{type(exc).__name__}: {exc}"
            continue
        row["kvpage_tokens"] = [t for t, _ in ours]
        row["hf_tokens"] = hf_tokens
        g_hf, s_hf = Greedy(), Stepwise()
        hf_path = []
        for i, (p, (tok, logits), hf_tok) in enumerate(zip(prompts, ours, hf_tokens, strict=True)):
            g_hf.add(i, tok, hf_tok, logits)
            path_logits = hf_logits(model, p + tok[:-1])[len(p) - 1:]
            hf_path.append(path_logits)
            for step, (mine, theirs) in enumerate(zip(logits, path_logits, strict=True)):
                lp = log_softmax(theirs)
                top = np.argsort(theirs)[::-1][:5]
                s_hf.add(i, step, mine, [(int(t), float(lp[t])) for t in top],
                         float(theirs[top[0]] - theirs[int(np.argmax(mine))]))
        row["vs_hf"] = (g_hf, s_hf)
        if fixture in ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe") and outtype == "f32":
            paths = [p + t for p, t in zip(prompts, row["kvpage_tokens"], strict=True)]
            row["router"] = router_gap(model, paths)
        if args.no_server:
            continue
        g_cpp, s_cpp, g_cpp_hf, s_cpp_hf = Greedy(), Stepwise(), Greedy(), Stepwise()
        try:
            with llama_server(path, work / f"server-{outtype}.log") as base:
                cpp = [server_greedy(base, p, n) for p in prompts]
                for i, (p, (tok, logits)) in enumerate(zip(prompts, ours, strict=True)):
                    for step in range(n):
                        argmax, top = server_top(base, p + tok[:step])
                        s_cpp.add(i, step, logits[step], top, their_argmax=argmax)
                        # the same llama-server answers against transformers' logits
                        s_cpp_hf.add(i, step, hf_path[i][step], top, their_argmax=argmax)
            for i, ((tok, logits), c_tok, hf_tok) in enumerate(
                    zip(ours, cpp, hf_tokens, strict=True)):
                g_cpp.add(i, tok, c_tok, logits)
                g_cpp_hf.add(i, c_tok, hf_tok)
            row["cpp_tokens"] = cpp
        except Exception as exc:  # noqa: BLE001
            lines = (work / f"server-{outtype}.log").read_text().strip().splitlines()
            err = next((ln for ln in lines if " E " in ln), str(exc))
            row["server_error"] = err.split(" E ", 1)[-1].strip()
        row["vs_cpp"] = (g_cpp, s_cpp)
        row["cpp_vs_hf"] = (g_cpp_hf, s_cpp_hf)
    return result


def moe_note(facts: dict[str, Any]) -> str:
    keys = {k: v for k, v in facts["keys"].items() if "expert" in k}
    exps = {k: v for k, v in facts["blk0"].items() if "exps" in k or "shexp" in k
            or "gate_inp" in k}
    if not keys and not exps:
        return ""
    return (f"arch `{facts['arch']}`; " + ", ".join(f"{k}={v}" for k, v in keys.items())
            + "; blk.0: " + ", ".join(f"{k} {v[0]} {v[1]}" for k, v in sorted(exps.items())))


def print_table(results: list[dict[str, Any]]) -> None:
    print()
    print("Greedy: prompts (of 3) whose 16 new tokens are equal (else where they diverge). "
          "Per step: teacher-forced on kvpage's greedy tokens, steps (of 48) where both "
          "sides' argmax agree, and the largest |log-prob difference| over the second "
          "side's top-5 tokens.")
    print()
    print("| architecture | GGUF | converter OK | kvpage vs transformers: greedy | per step "
          "| kvpage vs llama-server: greedy | per step | llama-server vs transformers: greedy "
          "| per step |")
    print("|---|---|---|---|---|---|---|---|---|")
    notes = []
    for res in results:
        for row in res["rows"]:
            name, outtype = res["name"], row["outtype"]
            if not row["converter_ok"]:
                print(f"| {name} | {outtype} | **no**: {row.get('error', '')} | | | | | | |")
                continue
            if row.get("kvpage_error"):
                print(f"| {name} | {outtype} | yes | **kvpage failed**: {row['kvpage_error']} "
                      "| | | | | |")
                continue
            g_hf, s_hf = row["vs_hf"]
            if "vs_cpp" in row and not row.get("server_error"):
                g_cpp, s_cpp = row["vs_cpp"]
                g_ch, s_ch = row["cpp_vs_hf"]
                cpp = f"{g_cpp.cell()} | {s_cpp.cell()} | {g_ch.cell()} | {s_ch.cell()}"
            elif row.get("server_error"):
                cpp = f"**llama-server failed**: {row['server_error']} | | | "
            else:
                cpp = "not run | | | "
            print(f"| {name} | {outtype} | yes | {g_hf.cell()} | {s_hf.cell()} | {cpp} |")
            pairs = [("kvpage vs transformers", g_hf, s_hf)]
            if "vs_cpp" in row:
                pairs.append(("kvpage vs llama-server", *row["vs_cpp"]))
            for label, g, s in pairs:
                for note in g.notes:
                    notes.append(f"- {name} {outtype} {label}, greedy: {note}")
                for note in s.notes[:4]:
                    notes.append(f"- {name} {outtype} {label}, per step: {note}")
                if len(s.notes) > 4:
                    notes.append(f"- {name} {outtype} {label}, per step: ... "
                                 f"{len(s.notes) - 4} more disagreeing steps")
            if row.get("router"):
                notes.append(f"- {name}: {row['router']}")
            if row["outtype"] == args_outtypes_first[0]:
                moe = moe_note(row["facts"])
                if moe:
                    notes.append(f"- {name} (as converted): {moe}")
                swa = {k: v for k, v in row["facts"]["keys"].items()
                       if "swa" in k or "sliding" in k}
                if swa:
                    notes.append(f"- {name} (window / local RoPE keys as converted): {swa}")
            if outtype != "f32":
                notes.append(f"- {name} {outtype}: tensor types {row['facts']['types']}")
    if notes:
        print()
        print("\n".join(notes))


args_outtypes_first = ["f32"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--archs", default=",".join(ARCHS))
    parser.add_argument("--outtypes", default="f32,q8_0")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/llama_cpp_agreement"))
    parser.add_argument("--no-server", action="store_true")
    parser.add_argument("--json", type=Path, help="also write the raw results here")
    args = parser.parse_args()
    args.outtypes = args.outtypes.split(",")
    args_outtypes_first[0] = args.outtypes[0]
    args.workdir.mkdir(parents=True, exist_ok=True)
    results = []
    for name in args.archs.split(","):
        t0 = time.time()
        try:
            results.append(run_arch(name, args))
        except Exception as exc:  # noqa: BLE001
            import traceback

            traceback.print_exc()
            results.append(dict(name=name, rows=[dict(outtype="-", converter_ok=False,
                                                      error=f"{type(exc).__name__}: {exc}")]))
        print(f"[{name}] done in {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    print_table(results)
    if args.json:
        def default(o: Any) -> Any:
            if isinstance(o, (Greedy, Stepwise)):
                return o.__dict__
            if isinstance(o, np.generic):
                return o.item()
            return str(o)

        args.json.write_text(json.dumps(results, default=default, indent=1))


if __name__ == "__main__":
    main()
