"""Grammar masks through the Python binding, as the engine asks for them: one
``Scheduler.fill_token_bitmask`` call per step (GIL released, int32 array out) with
1 / 16 / 64 constrained sequences walking the JSON schema of
``benches/structured_host.py`` with uniformly random allowed tokens; no model runs.

    python3 benches/structured_binding.py [tiny] [GGUF_OR_HF_MODEL ...]
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from kvpage._core import GrammarVocab, Scheduler
from kvpage.structured_outputs.vocab import token_bytes

sys.path.insert(0, str(Path(__file__).parent))
from structured_host import SCHEMA  # noqa: E402


def tokenizer(name: str) -> tuple[Any, int]:
    if name == "tiny":
        from kvpage.model.tiny_model import build_tokenizer

        tok = build_tokenizer()
        return tok, len(tok)
    from kvpage.engine.llm_engine import load_model_and_tokenizer

    config, _, tok, _ = load_model_and_tokenizer(name)
    return tok, config.vocab_size


def measure(vocab: GrammarVocab, eos: int, rows: int, seed: int = 0) -> tuple[float, int]:
    grammar = vocab.compile("json", json.dumps(SCHEMA))
    rng = np.random.default_rng(seed)
    sched = Scheduler(4096, 16, max_num_seqs=rows, max_num_batched_tokens=8192,
                      max_model_len=1024, eos_token_ids=[eos])
    for r in range(rows):
        sched.set_grammar(sched.add_request(np.arange(8) + r, max_tokens=400), grammar)
    total, count = 0.0, 0
    while sched.has_unfinished_requests():
        plan = sched.schedule()
        if plan.num_sampled == 0:
            sched.update(np.zeros(0, np.int32))
            continue
        start = time.perf_counter()
        masks = sched.fill_token_bitmask(vocab.words)
        total += time.perf_counter() - start
        count += plan.num_sampled
        bits = np.unpackbits(masks.view(np.uint8), axis=1, bitorder="little")
        picks = [int(rng.choice(np.flatnonzero(b[: vocab.vocab_size]))) for b in bits]
        sched.update(np.asarray(picks, np.int32))
    return total, count


def main() -> None:
    for name in sys.argv[1:] or ["tiny"]:
        tok, size = tokenizer(name)
        start = time.perf_counter()
        vocab = GrammarVocab(token_bytes(tok, size), [tok.eos_token_id])
        built = time.perf_counter() - start
        for rows in (1, 16, 64):
            total, count = measure(vocab, tok.eos_token_id, rows)
            print(f"{name}: vocab {size} (indexed in {1e3 * built:.0f} ms), {rows:>2} constrained "
                  f"rows/step: {1e6 * total / count:.1f} us per constrained seq-step "
                  f"({count} seq-steps)")


if __name__ == "__main__":
    main()
