"""The prompts of ``kvpage bench rollout``: GRPO's short questions, and long prompts
(a made-up record of ~N tokens, then a question about it) for the shape where prefill
dominates: math with context, code, agent transcripts."""

from __future__ import annotations

import random
from typing import Any

SHORT_PROMPTS = [
    "Solve step by step: a farmer has 17 sheep and buys 3 times as many. How many now?",
    "Write a haiku about the sea at night.",
    "What is the capital of Australia, and why is it not Sydney?",
    "Explain recursion to a ten year old in two sentences.",
    "List three prime numbers greater than 50 and explain how you checked them.",
    "Translate 'the cat sleeps on the warm roof' into French.",
    "If a train leaves at 3 pm going 60 km/h, how far has it gone by 5:30 pm?",
    "Give a short argument for and against remote work.",
    "What does the Python expression sorted([3, 1, 2])[::-1] return?",
    "Name two differences between a virus and a bacterium.",
    "Summarise the plot of Romeo and Juliet in one sentence.",
    "How many minutes are there in a week? Show the arithmetic.",
    "Suggest a name for a bakery that only sells bread made with rye.",
    "Why is the sky blue? Answer briefly.",
    "Write a function signature in Rust that sums a slice of i64.",
    "What is 12 squared minus 7 squared?",
]

_ITEMS = ["crate", "barrel", "parcel", "sack", "drum", "case", "bale", "carton"]
_GOODS = ["apples", "copper wire", "wool", "tea", "nails", "rice", "glass", "salt"]
_PLACES = ["Lisbon", "Oslo", "Tunis", "Kyoto", "Quito", "Perth", "Riga", "Dakar"]


def long_prompt(tokenizer: Any, index: int, num_tokens: int) -> str:
    """A warehouse ledger of about ``num_tokens`` tokens (at most that many), then a
    question; each ``index`` gives a different ledger."""
    rng = random.Random(1000 + index)
    question = (f"\nQuestion {index}: which entries above went to {rng.choice(_PLACES)}, "
                "and what is their total weight? Think step by step.")
    budget = num_tokens - len(tokenizer.encode(question))
    lines: list[str] = [f"Ledger {index} of the harbour warehouse."]
    used = len(tokenizer.encode(lines[0]))
    while True:
        line = (f"\nEntry {len(lines)}: {rng.randint(2, 90)} {rng.choice(_ITEMS)}s of "
                f"{rng.choice(_GOODS)}, {rng.randint(5, 900)} kg each, shipped to "
                f"{rng.choice(_PLACES)} on day {rng.randint(1, 365)}.")
        cost = len(tokenizer.encode(line))
        if used + cost > budget:
            break
        lines.append(line)
        used += cost
    return "".join(lines) + question


def prompts(tokenizer: Any, count: int, long_tokens: int | None) -> list[str]:
    """``count`` distinct prompts: the short ones (cycled), or long ones of
    ``long_tokens`` tokens."""
    if long_tokens:
        return [long_prompt(tokenizer, i, long_tokens) for i in range(count)]
    return [SHORT_PROMPTS[i % len(SHORT_PROMPTS)] for i in range(count)]
