"""A node with adaptive k (engine/spec_decode/adaptive_k.py): greedy output still equals the
single-process engine's without MTP, Status counts the steps at each k, and the draft counters
for /metrics count only the steps that verified drafts."""

from __future__ import annotations

import random
import threading

import pytest

from decode_node.colocated import ColocatedNode
from engine.engine import EngineConfig, LLMEngine, resolve_request
from engine.model.loader import load_model
from engine.sampling.sampling_params import SamplingParams
from protos.messages import OutputItem
from tests.engine.test_adaptive_k import SWITCHES, K, Scripted


@pytest.mark.parametrize("script", [SWITCHES, [0] * 1000], ids=["switching", "plain"])
def test_colocated_node_switching_k_is_exact_and_counts_steps_by_k(script):
    tiny = load_model("tiny")
    node = ColocatedNode(tiny, EngineConfig(num_speculative_tokens=K, max_num_batched_tokens=16,
                                            block_shuffle_seed=5, spec_k_policy="adaptive"))
    node.batch.policy = Scripted(script)
    items: list[OutputItem] = []
    done = threading.Condition()
    sub = node.subscribe()

    def read() -> None:
        while (batch := sub.get()) is not None:
            with done:
                items.extend(batch)
                done.notify_all()

    threading.Thread(target=read, daemon=True).start()
    node.start()
    try:
        rng = random.Random(3)
        ps = [[rng.randrange(256) for _ in range(n)] for n in (1, 7, 16, 33, 5, 12)]
        params = SamplingParams(max_tokens=20, ignore_eos=True)
        for i, p in enumerate(ps):
            req = resolve_request(f"r{i}", p, params, tiny.eos_token_ids, node.max_model_len, random.Random(0),
                                  tiny.model.config.vocab_size)
            assert node.submit(f"r{i}", p, params, req.seed, req.stop_ids).result(timeout=30).admitted
        with done:
            assert done.wait_for(lambda: sum(1 for i in items if i.finish_reason) == len(ps), 120)
        ref = LLMEngine(tiny, EngineConfig()).generate(ps, params)
        for i, want in enumerate(ref):
            assert [t for it in items if it.request_id == f"r{i}" for t in it.tokens] == want.output_ids
        status = node.status()
        steps = status["spec_decode_steps"]
        assert steps == node.batch.k_steps and steps[0] > 0 and sum(steps[1:K]) == 0
        drafts, accepted = status["draft_tokens"], status["accepted_per_pos"]
        if script is SWITCHES:
            assert steps[K] > 0 and drafts == [drafts[0]] * K and drafts[0] > 0
            assert accepted == sorted(accepted, reverse=True) and accepted[0] <= drafts[0]
        else:  # plain steps verify no drafts: none counted
            assert steps[K] == 0 and drafts == [0] * K and accepted == [0] * K
    finally:
        node.stop()
