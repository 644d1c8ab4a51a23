"""The lockstep protocol (:mod:`kvpage.engine.lockstep`) between two real engines in one
process, through an in-memory channel: a follower that applies process 0's messages
ends every step in the same state and samples the same tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvpage.engine.config import EngineConfig
from kvpage.engine.llm_engine import LLMEngine
from kvpage.engine.lockstep import LockstepLeader, follow
from kvpage.sampling.params import SamplingParams


class MemoryChannel:
    def __init__(self) -> None:
        self.messages: dict[int, dict[str, Any]] = {}

    def publish(self, n: int, message: dict[str, Any]) -> None:
        assert n not in self.messages and n == len(self.messages)
        self.messages[n] = message

    def fetch(self, n: int) -> dict[str, Any]:
        return self.messages[n]


def _engine(model: Path) -> LLMEngine:
    return LLMEngine.from_config(EngineConfig(model=str(model), max_num_seqs=4,
                                              max_model_len=128, max_num_batched_tokens=32))


def test_a_follower_replays_adds_aborts_and_steps(tiny_model_dir: Path) -> None:
    channel = MemoryChannel()
    leader = LockstepLeader(_engine(tiny_model_dir), channel)  # type: ignore[arg-type]
    sampled = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=10, ignore_eos=True, seed=7)
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    leader.add_request("a", "The quick brown fox", sampled)
    leader.add_request("b", "Once upon a time", greedy)
    tokens: dict[str, list[int]] = {}
    for i in range(30):
        if i == 2:
            leader.add_request("c", "A third prompt arrives late", greedy)
        if i == 3:
            leader.abort_request(["b"])
        if not leader.has_unfinished_requests():
            break
        for out in leader.step():
            tokens[out.request_id] = list(out.outputs[0].token_ids)
    leader.close()

    follower = _engine(tiny_model_dir)
    followed: dict[str, list[int]] = {}
    original_step = follower.step

    def step() -> list[Any]:
        outputs = original_step()
        for out in outputs:
            followed[out.request_id] = list(out.outputs[0].token_ids)
        return outputs

    follower.step = step  # type: ignore[method-assign]
    steps = follow(follower, channel)  # type: ignore[arg-type]
    assert steps == sum(m["step"] for m in channel.messages.values())
    assert followed == tokens and set(tokens) == {"a", "b", "c"}
    assert not follower.has_unfinished_requests()
    assert follower.scheduler.kv_cache_usage_perc == 0.0
