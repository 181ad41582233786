"""The decode node's prefix cache (issue 19, part 2): only the blocks the decode node lacks cross
the wire. PrefillNode + DecodeNode as plain objects (tests/decode_node/test_pd_nodes.py `Pair`),
over the `local`, `ucx` and `tcp` kvtransfer backends."""

from __future__ import annotations

import random

import pytest
import torch

from engine.engine import EngineConfig, LLMEngine, resolve_request
from engine.model.loader import load_model
from engine.sampling.sampling_params import SamplingParams
from prefill_node.node import PrefillJob
from tests.decode_node.test_pd_nodes import Pair, reference, run_concurrently, wait_until

BS = 16  # EngineConfig's default block size
D_CACHE = {"enable_prefix_caching": True}


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny")


def chat_prompts(vocab, seed=2):
    """Three conversations sharing a 40-token system prompt, two turns each."""
    rng = random.Random(seed)
    system = [rng.randrange(vocab) for _ in range(40)]
    turns = [[rng.randrange(vocab) for _ in range(12)] for _ in range(6)]
    return [system + turns[c] + turns[c + 1][: 3 + t] for c in range(3) for t in range(2)]


def kv_sent_blocks(prompts, skip):
    return sum(-(-len(p) // BS) - skip(p) for p in prompts)


def assert_no_leak(pair):
    for side in (pair.prefill, pair.decode):
        wait_until(lambda side=side: side.status()["free_blocks"] == side.blocks.capacity)
        assert all(side.blocks.refcount(b) == 0 for b in range(1, side.blocks.num_blocks))


@pytest.mark.parametrize(("k", "backend"), [(0, "local"), (3, "local"), (3, "ucx"), (3, "tcp")])
def test_decode_hits_send_only_the_rest_and_keep_greedy_output(tiny, k, backend):
    vocab = tiny.model.config.vocab_size
    prompts = chat_prompts(vocab)
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    ref = reference(tiny, prompts, params)  # no cache anywhere, no MTP
    pair = Pair(tiny, k, backend=backend, decode_kw=D_CACHE)  # the prefill node caches nothing
    block_bytes = pair.prefill._kv_block_bytes
    try:
        assert run_concurrently(pair, prompts, params, vocab, "a") == ref
        cold = pair.prefill.counters["kv_bytes"]
        assert cold <= kv_sent_blocks(prompts, lambda p: 0) * block_bytes
        assert run_concurrently(pair, prompts, params, vocab, "b") == ref
        warm = pair.prefill.counters["kv_bytes"] - cold
        # round b: every full block before each prompt's last token is on D already
        assert warm == kv_sent_blocks(prompts, lambda p: (len(p) - 1) // BS) * block_bytes
        assert warm * 3 < kv_sent_blocks(prompts, lambda p: 0) * block_bytes  # vs no decode-side cache
        assert pair.decode.status()["kv_bytes"] == cold + warm  # what D received, counted on its side
        skipped = sum((len(p) - 1) // BS for p in prompts) * block_bytes
        assert pair.prefill.counters["kv_skipped_bytes"] >= skipped
        assert pair.decode.status()["kv_skipped_bytes"] == pair.prefill.counters["kv_skipped_bytes"]
        assert pair.decode.status()["prefix_hit_requests"] >= len(prompts)
        assert_no_leak(pair)
        assert pair.decode.blocks.num_cached > 0 and pair.prefill.blocks.num_cached == 0
    finally:
        pair.close()


def test_decode_cached_blocks_are_what_d_reads(tiny):
    """Wipe D's cached blocks (every layer): the next hits then decode from zeros, so the output
    changes. Shows the hits are really read, so the equality above is not vacuous."""
    vocab = tiny.model.config.vocab_size
    prompts = chat_prompts(vocab, seed=5)[:2]
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    ref = reference(tiny, prompts, params)
    pair = Pair(tiny, 0, decode_kw=D_CACHE)
    try:
        assert run_concurrently(pair, prompts, params, vocab, "a") == ref
        cached = [b for b in range(1, pair.decode.blocks.num_blocks) if b in pair.decode.blocks._hash_of]
        assert cached
        for layer in pair.decode.runner.kv.layers:
            layer[:, cached] = 0
        assert run_concurrently(pair, prompts, params, vocab, "b") != ref
    finally:
        pair.close()


def test_decode_cache_holds_the_engines_kv_for_every_layer_mtp_included(tiny):
    """A block D cached under a hash holds the KV the single-process engine computes for the block
    under the same hash, in the target layers and in the MTP layer (whose last position reads
    the next block's first token: the hash covers it)."""
    vocab = tiny.model.config.vocab_size
    prompt = chat_prompts(vocab, seed=7)[0]
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    eng = LLMEngine(tiny, EngineConfig(num_speculative_tokens=3, enable_prefix_caching=True))
    eng.generate([prompt], params)
    pair = Pair(tiny, 3, decode_kw=D_CACHE)
    try:
        run_concurrently(pair, [prompt], params, vocab, "a")
        hashes = pair.decode.prefix.hashes(prompt)
        assert hashes == eng.prefix.hashes(prompt) and len(hashes) == (len(prompt) - 1) // BS
        d_blocks, e_blocks = pair.decode.blocks.match(hashes), eng.blocks.match(hashes)
        assert len(d_blocks) == len(e_blocks) == len(hashes)
        layers = pair.decode.runner.kv.layers
        assert len(layers) == tiny.model.config.num_hidden_layers + 1  # the MTP layer is last
        for d_kv, e_kv in zip(layers, eng.runner.kv.layers, strict=True):
            torch.testing.assert_close(d_kv[:, d_blocks], e_kv[:, e_blocks], atol=1e-5, rtol=1e-5)
    finally:
        pair.close()


@pytest.mark.parametrize("k", [0, 2])
def test_with_mtp_a_block_hits_only_when_the_next_token_matches(tiny, k):
    vocab = tiny.model.config.vocab_size
    rng = random.Random(11)
    base = [rng.randrange(vocab) for _ in range(40)]
    other = base[:BS] + [(base[BS] + 1) % vocab] + base[BS + 1 :]  # block 0 same, the token after differs
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    pair = Pair(tiny, k, decode_kw=D_CACHE)
    try:
        run_concurrently(pair, [base], params, vocab, "a")
        skips = []
        for i, p in enumerate([base, other]):
            req = resolve_request(f"s{i}", p, params, pair.eos, pair.max_model_len, random.Random(0), vocab)
            res = pair.decode.reserve(f"s{i}", len(p), params, req.seed, req.stop_ids, p).result(timeout=30)
            skips.append(res.descriptor["skip"])
            pair.decode.abort(f"s{i}", "test done")
        assert skips == [(len(base) - 1) // BS, 0 if k else 1]
        pair.wait_terminal(["s0", "s1"])
        assert_no_leak(pair)
    finally:
        pair.close()


def reserve_job(pair, rid, prompt, params, vocab):
    req = resolve_request(rid, prompt, params, pair.eos, pair.max_model_len, random.Random(0), vocab)
    res = pair.decode.reserve(rid, len(prompt), params, req.seed, req.stop_ids, prompt).result(timeout=30)
    assert res.admitted, res.reason
    return PrefillJob(rid, prompt, params, req.seed, req.stop_ids, res.descriptor, "d0")


@pytest.mark.parametrize("tamper", [
    {"skip": 4}, {"skip": True}, {"skip": -1}, {"skip": "2"}, {"skip": 0}, {"blocks": []},
])
def test_prefill_refuses_a_skip_the_prompt_cannot_have(tiny, tamper):
    """`skip` comes from the network: past the prompt's full blocks, not an int, or not matching
    the destination list, the job is refused before anything is sent, and both sides free all."""
    vocab = tiny.model.config.vocab_size
    prompt = chat_prompts(vocab)[0]  # 55 tokens: 3 full blocks before the last token
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    pair = Pair(tiny, 2, decode_kw=D_CACHE)
    try:
        run_concurrently(pair, [prompt], params, vocab, "warm")
        job = reserve_job(pair, "t", prompt, params, vocab)
        assert job.descriptor["skip"] == 3
        job.descriptor = {**job.descriptor, **tamper}
        with pytest.raises(ValueError, match="bad KV descriptor"):
            pair.prefill.submit(job).result(timeout=30)
        pair.decode.abort("t", "prefill refused")
        pair.wait_terminal(["t"])
        assert_no_leak(pair)
    finally:
        pair.close()


def after_first_layer(pair, rid, action):
    """Run `action` on the prefill loop right after layer 0 of `rid` is queued for sending: the
    rest of its KV is then still on the way, whatever the machine's speed."""
    push = pair.prefill._push_layer

    def hooked(jobs, layer, ready=None):
        push(jobs, layer, ready)
        if layer == 0 and any(j.request_id == rid for j in jobs):
            action()
    pair.prefill._push_layer = hooked


def test_aborts_during_transfer_and_decode_drop_the_references_they_took(tiny):
    vocab = tiny.model.config.vocab_size
    prompts = chat_prompts(vocab, seed=9)
    params = SamplingParams(max_tokens=400, ignore_eos=True)
    pair = Pair(tiny, 2, decode_kw=D_CACHE, max_num_batched_tokens=16)
    try:
        run_concurrently(pair, prompts[:2], SamplingParams(max_tokens=3, ignore_eos=True), vocab, "warm")
        cached = pair.decode.blocks.num_cached

        def abort_on_decode():
            pair.decode.abort("mid", "client went away")
            wait_until(lambda: "mid" not in pair.decode.pending)
        after_first_layer(pair, "mid", abort_on_decode)
        job = reserve_job(pair, "mid", prompts[2], params, vocab)
        assert job.descriptor["skip"] == 2  # the shared system prompt's two blocks
        pair.prefill.submit(job).result(timeout=30)
        after_first_layer(pair, "pab", lambda: pair.prefill.sender.abort("pab", "client went away"))
        pair.prefill.submit(reserve_job(pair, "pab", prompts[3], params, vocab)).result(timeout=30)
        pair.run("dec", prompts[4], params, vocab)
        wait_until(lambda: "dec" not in pair.decode.pending)  # inserted: decoding
        pair.decode.abort("dec", "client went away")
        pair.wait_terminal(["mid", "pab", "dec"])
        ends = [[i for i in pair.outputs[r] if i.finish_reason or i.error] for r in ("mid", "pab", "dec")]
        assert [len(e) for e in ends] == [1, 1, 1]
        assert ends[0][0].finish_reason == "abort" and "KV transfer failed" in ends[1][0].error
        assert ends[2][0].finish_reason == "abort"
        assert_no_leak(pair)
        assert pair.decode.blocks.num_cached == cached + 1  # "dec" added its third block; failed ones nothing
    finally:
        pair.close()


def test_decode_refuses_prompt_ids_that_do_not_match_the_reservation(tiny):
    vocab = tiny.model.config.vocab_size
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    pair = Pair(tiny, 0, decode_kw=D_CACHE)
    try:
        for rid, n, prompt in [("short", 5, [1, 2, 3]), ("vocab", 3, [1, vocab, 2]), ("neg", 2, [1, -1])]:
            res = pair.decode.reserve(rid, n, params, 0, (), prompt).result(timeout=30)
            assert not res.admitted and "inside the vocabulary" in res.reason
        assert_no_leak(pair)
    finally:
        pair.close()


def test_decode_evictions_keep_output_and_never_take_a_pinned_block(tiny):
    """A small decode cache: later prompts evict earlier cached blocks, output stays greedy-exact,
    and a request's pinned cached prefix survives other reservations that run the node full."""
    vocab = tiny.model.config.vocab_size
    prompts = chat_prompts(vocab, seed=13)  # 55-57 tokens: 4 prompt blocks, 5 with the answer's room
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    ref = reference(tiny, prompts, params)
    pair = Pair(tiny, 0, decode_kw={**D_CACHE, "num_blocks": 7})  # 6 usable: one such request at a time
    try:
        for rnd in range(2):
            for i, p in enumerate(prompts):
                assert run_concurrently(pair, [p], params, vocab, f"r{rnd}-{i}") == [ref[i]]
        assert pair.decode.blocks.evictions > 0
        job = reserve_job(pair, "pin", prompts[-1], params, vocab)
        pinned = pair.decode.blocks.match(pair.decode.prefix.hashes(prompts[-1]))[: job.descriptor["skip"]]
        assert pinned and all(pair.decode.blocks.refcount(b) == 1 for b in pinned)
        rng = random.Random(1)
        fresh = [[rng.randrange(vocab) for _ in range(3)] for _ in range(2)]  # 1 block each with the answer
        others = [pair.decode.reserve(f"o{i}", len(p), params, 0, (), p).result(timeout=30)
                  for i, p in enumerate(fresh)]
        assert [r.admitted for r in others] == [True, False]  # the last free blocks, then full: "pin" keeps its own
        assert pair.decode.blocks.match(pair.decode.prefix.hashes(prompts[-1]))[: len(pinned)] == pinned
        for rid in ["pin", "o0"]:
            pair.decode.abort(rid, "test done")
        pair.wait_terminal(["pin", "o0"])
        assert_no_leak(pair)
    finally:
        pair.close()
