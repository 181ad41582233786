"""ColocatedNode as a plain object: greedy output equals the single-process engine's (k = 0 and 3),
a long prompt's chunks interleave with the running requests' decode steps, an abort mid-stream or
mid-prefill ends with one terminal item, and every KV block comes back."""

from __future__ import annotations

import random
import threading

import pytest

from decode_node.colocated import ColocatedNode
from engine.engine import EngineConfig, LLMEngine, resolve_request
from engine.model.loader import load_model
from engine.sampling.sampling_params import SamplingParams
from protos.messages import OutputItem

BUDGET = 16  # max_num_batched_tokens: prompt tokens per prefill step


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny")


class Colocated:
    """A started node and everything it published, in order."""

    def __init__(self, loaded, k: int) -> None:
        self.loaded = loaded
        self.node = ColocatedNode(loaded, EngineConfig(num_speculative_tokens=k, max_num_batched_tokens=BUDGET,
                                                       block_shuffle_seed=5))
        self.start_free = self.node.blocks.num_free
        self.items: list[OutputItem] = []
        self.done = threading.Condition()
        sub = self.node.subscribe()
        threading.Thread(target=self._read, args=(sub,), daemon=True).start()
        self.node.start()

    def _read(self, sub) -> None:
        while (batch := sub.get()) is not None:
            with self.done:
                self.items += batch
                self.done.notify_all()

    def submit(self, rid: str, prompt: list[int], params: SamplingParams) -> None:
        req = resolve_request(rid, prompt, params, self.loaded.eos_token_ids, self.node.max_model_len,
                              random.Random(0), self.loaded.model.config.vocab_size)
        res = self.node.submit(rid, prompt, params, req.seed, req.stop_ids).result(timeout=30)
        assert res.admitted, res.reason

    def of(self, rid: str) -> list[OutputItem]:
        return [i for i in self.items if i.request_id == rid]

    def wait(self, cond, timeout: float = 120.0) -> None:
        with self.done:
            assert self.done.wait_for(cond, timeout), "timed out"

    def wait_ended(self, rids: list[str]) -> None:
        self.wait(lambda: all(any(i.finish_reason or i.error for i in self.of(r)) for r in rids))

    def tokens(self, rid: str) -> list[int]:
        return [t for i in self.of(rid) for t in i.tokens]

    def terminals(self, rid: str) -> int:
        return sum(1 for i in self.of(rid) if i.finish_reason or i.error)


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.choice([1, 7, 16, 33, 70]))] for _ in range(n)]


@pytest.mark.parametrize("k", [0, 3])
def test_greedy_colocated_equals_single_process(tiny, k):
    node = Colocated(tiny, k)
    try:
        ps, params = prompts(10, seed=k), SamplingParams(max_tokens=12, ignore_eos=True, logprobs=2)
        for i, p in enumerate(ps):
            node.submit(f"r{i}", p, params)
        node.wait_ended([f"r{i}" for i in range(len(ps))])
        ref = LLMEngine(tiny, EngineConfig()).generate(ps, params)
        for i, want in enumerate(ref):
            assert node.tokens(f"r{i}") == want.output_ids
            assert node.terminals(f"r{i}") == 1 and node.of(f"r{i}")[-1].finish_reason == "length"
            got_lps = [x for item in node.of(f"r{i}") if item.logprobs for x in item.logprobs.logprob]
            assert got_lps == pytest.approx([x.logprob for x in want.logprobs], abs=1e-4)  # the first token's too
        node.wait(lambda: node.node.blocks.num_free == node.start_free)
        assert node.node.status()["running"] == 0
    finally:
        node.node.stop()


def test_long_prompt_chunks_interleave_with_running_decode_steps(tiny):
    node = Colocated(tiny, 0)
    try:
        node.submit("run", [5, 6, 7], SamplingParams(max_tokens=400, ignore_eos=True))
        node.wait(lambda: len(node.tokens("run")) >= 3)
        long_prompt = [random.Random(1).randrange(256) for _ in range(8 * BUDGET)]
        steps_before = node.node.prefill_steps
        one = SamplingParams(max_tokens=1, ignore_eos=True)
        # A one-token marker admitted with the long prompt: its only token comes out in the round
        # that starts the long prompt (or the one before), which marks that point in the stream.
        futures = [node.node.submit("mark", [9], one, 0, ()),
                   node.node.submit("long", long_prompt, SamplingParams(max_tokens=4, ignore_eos=True), 0, ())]
        assert all(f.result(timeout=30).admitted for f in futures)
        node.wait_ended(["mark", "long"])
        with node.done:
            order = [i.request_id for i in node.items if i.tokens]
        between = order[order.index("mark") : order.index("long")]
        # The long prompt takes 8 prefill rounds; each round ran a decode step of the running
        # request, so its tokens kept coming between the chunks (all at once: about one).
        assert between.count("run") >= 7
        assert node.node.prefill_steps - steps_before >= 8
        node.node.abort("run")
        node.wait_ended(["run"])
        assert node.terminals("run") == 1 and node.terminals("long") == 1
        node.wait(lambda: node.node.blocks.num_free == node.start_free)
    finally:
        node.node.stop()


def test_abort_mid_stream_and_mid_prefill_end_once_and_free_blocks(tiny):
    node = Colocated(tiny, 3)
    try:
        node.submit("a", [1, 2, 3], SamplingParams(max_tokens=400, ignore_eos=True))
        node.wait(lambda: len(node.tokens("a")) >= 3)
        node.submit("b", list(range(6 * BUDGET)), SamplingParams(max_tokens=8, ignore_eos=True))
        node.node.abort("a")
        node.node.abort("b")  # mid-prefill (or before its first chunk)
        node.node.abort("nobody")
        node.wait_ended(["a", "b"])
        for rid in ("a", "b"):
            assert node.terminals(rid) == 1
            assert node.of(rid)[-1].finish_reason == "abort"
        node.wait(lambda: node.node.blocks.num_free == node.start_free)
        assert node.node.status()["running"] == 0 and node.node.status()["queued_tokens"] == 0
    finally:
        node.node.stop()


def test_refusals_name_the_reason(tiny):
    node = Colocated(tiny, 0)
    try:
        params = SamplingParams(max_tokens=4)
        too_long = node.node.submit("x", [1] * node.node.max_model_len, params, 0, ()).result(timeout=30)
        empty = node.node.submit("y", [], params, 0, ()).result(timeout=30)
        outside = node.node.submit("z", [10**6], params, 0, ()).result(timeout=30)
        assert not too_long.admitted and "context" in too_long.reason
        assert not empty.admitted and not outside.admitted and "vocabulary" in outside.reason
        assert node.node.blocks.num_free == node.start_free
    finally:
        node.node.stop()
