"""Prefix caching: the block manager's references, cache and LRU eviction; the hash chain; and the
engine with `enable_prefix_caching` giving exactly the output it gives without it."""

from __future__ import annotations

import pytest

from engine.cache.kv_cache import BlockManager, OutOfBlocks
from engine.cache.prefix_cache import block_hashes
from engine.engine import EngineConfig, LLMEngine
from engine.sampling.sampling_params import SamplingParams
from tests.engine.conftest import DEVICE
from tests.engine.test_engine import prompts_of, run_schedule

BS = 4


def h(i: int) -> bytes:
    return i.to_bytes(16, "little")


def cached_blocks(bm: BlockManager, n: int, first_hash: int = 0) -> list[int]:
    """n blocks allocated and registered under h(first_hash).. (still referenced)."""
    blocks = bm.allocate(n)
    for i, b in enumerate(blocks):
        assert bm.register(b, h(first_hash + i))
    return blocks


# ---- BlockManager ----------------------------------------------------------------------------
def test_match_finds_the_longest_cached_prefix_only():
    bm = BlockManager(16, BS)
    blocks = cached_blocks(bm, 3)
    assert bm.match([h(0), h(1), h(2), h(3)]) == blocks
    assert bm.match([h(0), h(9), h(2)]) == blocks[:1]
    assert bm.match([h(9), h(1)]) == []
    assert bm.num_cached == 3


def test_shared_blocks_are_counted_and_returned_once_per_reference():
    bm = BlockManager(16, BS)
    a = cached_blocks(bm, 2) + bm.allocate(1)
    b = bm.allocate_after(bm.match([h(0), h(1)]), 2)
    assert b[:2] == a[:2] and bm.refcount(a[0]) == 2
    assert bm.num_free == bm.capacity - 5
    bm.free(a)
    assert bm.refcount(a[0]) == 1 and bm.num_evictable == 0  # b still holds the shared blocks
    bm.free(b)
    assert bm.num_free == bm.capacity and bm.num_evictable == 2 and bm.num_cached == 2
    with pytest.raises(ValueError, match="double free"):
        bm.free(b[:1])


def test_a_block_in_use_is_never_evicted():
    bm = BlockManager(9, BS)  # 8 usable
    held = cached_blocks(bm, 2, first_hash=0)
    gone = cached_blocks(bm, 3, first_hash=10)
    bm.free(gone)
    assert bm.num_free == 6  # 3 never used + 3 evictable
    fresh = bm.allocate(6)
    assert set(held).isdisjoint(fresh)
    assert bm.match([h(0), h(1)]) == held  # still cached
    assert bm.match([h(10)]) == [] and bm.evictions == 3
    with pytest.raises(OutOfBlocks):
        bm.allocate(1)


def test_eviction_takes_never_cached_blocks_first_then_least_recently_freed():
    bm = BlockManager(9, BS)
    old = cached_blocks(bm, 2, first_hash=0)
    new = cached_blocks(bm, 2, first_hash=10)
    bm.free(old)
    bm.free(new)
    bm.allocate(4)  # the never-cached ones
    assert bm.evictions == 0 and bm.num_cached == 4
    bm.allocate(1)  # the least recently freed: old's later block goes first
    assert bm.match([h(0)]) == old[:1] and bm.match([h(0), h(1)]) == old[:1]
    assert bm.match([h(10), h(11)]) == new


def test_reviving_an_evictable_block_needs_room_and_takes_it_out_of_the_lru():
    bm = BlockManager(5, BS)  # 4 usable
    blocks = cached_blocks(bm, 2)
    bm.free(blocks)
    other = bm.allocate(2)
    cached = bm.match([h(0), h(1)])
    assert not bm.can_allocate(cached, 1)  # reviving 2 + 1 new > 2 free
    with pytest.raises(OutOfBlocks):
        bm.allocate_after(cached, 1)
    assert bm.num_free == 2 and bm.refcount(blocks[0]) == 0  # nothing taken
    got = bm.allocate_after(cached, 0)
    assert got == blocks and bm.num_free == 0 and bm.num_evictable == 0
    bm.free(got + other)
    assert bm.num_free == bm.capacity


def test_register_needs_a_block_in_use_and_keeps_the_first_block_for_a_hash():
    bm = BlockManager(8, BS)
    a, b = bm.allocate(2)
    assert bm.register(a, h(0))
    assert not bm.register(b, h(0))  # a duplicate computed concurrently stays private
    assert not bm.register(a, h(1))
    bm.free([a, b])
    assert bm.num_evictable == 1
    with pytest.raises(ValueError, match="not in use"):
        bm.register(b, h(5))


def test_clear_cache_gives_every_evictable_block_back():
    bm = BlockManager(8, BS)
    held = cached_blocks(bm, 2, first_hash=0)
    bm.free(cached_blocks(bm, 3, first_hash=10))
    assert bm.clear_cache() == 3
    assert bm.num_evictable == 0 and bm.num_cached == 2 and bm.num_free == bm.capacity - 2
    bm.free(held)
    assert bm.clear_cache() == 2 and bm.num_cached == 0 and bm.num_free == bm.capacity


# ---- the hash chain --------------------------------------------------------------------------
def test_hash_chain_covers_every_token_before_a_block_and_not_the_last_token():
    p = list(range(1, 14))  # 13 tokens, BS 4: blocks end at 4, 8, 12 < 13 -> 3 cacheable
    hs = block_hashes(p, BS, b"m", 0)
    assert len(hs) == 3 and len(set(hs)) == 3
    assert len(block_hashes(p[:12], BS, b"m", 0)) == 2  # block 3's end is the last token
    changed = block_hashes([99] + p[1:], BS, b"m", 0)
    assert all(x != y for x, y in zip(hs, changed, strict=True))  # a chain: block 0 changes all
    later = block_hashes(p[:5] + [99] + p[6:], BS, b"m", 0)
    assert later[0] == hs[0] and later[1] != hs[1]
    assert block_hashes(p, BS, b"other model", 0)[0] != hs[0]


def test_mtp_lookahead_keys_a_block_by_the_token_after_it():
    p = list(range(1, 14))
    next_changed = p[:4] + [99] + p[5:]
    assert block_hashes(next_changed, BS, b"m", 0)[0] == block_hashes(p, BS, b"m", 0)[0]
    assert block_hashes(next_changed, BS, b"m", 1)[0] != block_hashes(p, BS, b"m", 1)[0]


# ---- the engine ------------------------------------------------------------------------------
def engine(loaded, k=0, cache=True, **kw):
    cfg = EngineConfig(num_speculative_tokens=k, block_size=BS, device=DEVICE, block_shuffle_seed=3,
                       enable_prefix_caching=cache, **kw)
    return LLMEngine(loaded, cfg)


def chat_prompts(vocab, turns=3):
    """Conversations sharing a system prompt, each turn the previous prompt plus more."""
    system, = prompts_of([21], vocab, seed=1)
    out = []
    for c in range(3):
        history = system + prompts_of([5 + c], vocab, seed=10 + c)[0]
        for t in range(turns):
            history = history + prompts_of([7], vocab, seed=100 * c + t)[0]
            out.append(list(history))
    return out


@pytest.mark.parametrize("k", [0, 2])
def test_greedy_with_cache_hits_equals_without_cache(tiny, k):
    prompts = chat_prompts(tiny.model.config.vocab_size)
    params = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=3)
    plain = engine(tiny, k, cache=False).generate(prompts, params)
    eng = engine(tiny, k)
    first = eng.generate(prompts, params)  # one batch: the system prompt is computed by several
    again = eng.generate(prompts, params)  # every prefix is cached now
    for got in (first, again):
        assert [r.output_ids for r in got] == [r.output_ids for r in plain]
        for r, ref in zip(got, plain, strict=True):
            assert [lp.logprob for lp in r.logprobs] == pytest.approx([lp.logprob for lp in ref.logprobs], abs=1e-5)
    st = eng.prefix.stats
    assert st.hit_requests >= len(prompts) and st.hit_tokens > sum(len(p) for p in prompts) // 2
    assert eng.num_free_blocks == eng.blocks.capacity and eng.blocks.num_cached > 0


def test_turn_by_turn_prefill_starts_after_the_cached_prefix(tiny):
    prompts = chat_prompts(tiny.model.config.vocab_size, turns=4)[:4]  # one conversation
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    eng, plain = engine(tiny, 2), engine(tiny, 2, cache=False)
    for p in prompts:
        assert eng.generate([p], params)[0].output_ids == plain.generate([p], params)[0].output_ids
    st = eng.prefix.stats
    expect = sum(((len(p) - 1) // BS) * BS for p in prompts[:-1])  # turn t reuses turn t-1's full blocks
    assert st.hit_tokens == expect and st.hit_requests == len(prompts) - 1


def test_seeded_sampling_is_unchanged_by_a_cache_hit(tiny):
    prompts = chat_prompts(tiny.model.config.vocab_size)
    params = [SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, seed=i, ignore_eos=True)
              for i in range(len(prompts))]
    plain = engine(tiny, 2, cache=False).generate(prompts, params)
    eng = engine(tiny, 2)
    eng.generate(prompts, params)
    assert [r.output_ids for r in eng.generate(prompts, params)] == [r.output_ids for r in plain]


def test_concurrent_joins_under_eviction_keep_outputs_and_return_every_block(tiny):
    prompts = chat_prompts(tiny.model.config.vocab_size, turns=4)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    joins = [(i // 2, p) for i, p in enumerate(prompts)] + [(9 + i, p) for i, p in enumerate(prompts)]
    plain = run_schedule(engine(tiny, 2, cache=False), joins, params)
    eng = engine(tiny, 2, num_blocks=48, max_num_batched_tokens=16)  # too small to keep every prefix
    got = run_schedule(eng, joins, params)
    assert [r.output_ids for r in got] == [r.output_ids for r in plain]
    assert eng.blocks.evictions > 0 and eng.prefix.stats.hit_tokens > 0
    assert eng.num_free_blocks == eng.blocks.capacity
    assert all(eng.blocks.refcount(b) == 0 for b in range(1, eng.blocks.num_blocks))
    eng.blocks.clear_cache()
    assert eng.blocks.num_cached == 0 and eng.num_free_blocks == eng.blocks.capacity


def test_aborts_in_prefill_and_in_decode_drop_their_references(tiny):
    prompts = chat_prompts(tiny.model.config.vocab_size)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    eng = engine(tiny, 2, max_num_batched_tokens=8)
    eng.generate(prompts[:2], params)  # warm the cache
    ids = [eng.add_request(p, params) for p in prompts]
    eng.step()
    eng.abort(ids[0])  # mid-prefill, sharing cached blocks
    for _ in range(12):
        eng.step()
    for rid in ids[1:]:
        eng.abort(rid)
    while eng.has_unfinished():
        eng.step()
    assert all(eng.requests[r].finish_reason == "abort" for r in ids[:1])
    assert eng.num_free_blocks == eng.blocks.capacity
    assert all(eng.blocks.refcount(b) == 0 for b in range(1, eng.blocks.num_blocks))


def test_prompts_diverging_right_after_a_block_keep_their_mtp_drafts(tiny):
    """The MTP layer's KV at a block's last position reads the next token: a prompt that shares
    the block but not the token after it must not reuse it (drafts, hence sampled tokens, differ)."""
    vocab = tiny.model.config.vocab_size
    base, tail = prompts_of([3 * BS, 9], vocab, seed=5)
    prompts = [base + [x] + tail for x in (1, 2, 3, 4)]
    params = [SamplingParams(max_tokens=16, temperature=1.0, seed=7, ignore_eos=True)] * len(prompts)
    plain = engine(tiny, 2, cache=False).generate(prompts, params)
    eng = engine(tiny, 2)
    got = [eng.generate([p], [sp])[0] for p, sp in zip(prompts, params, strict=True)]
    assert [r.output_ids for r in got] == [r.output_ids for r in plain]
    assert [(r.steps, r.accepted_tokens) for r in got] == [(r.steps, r.accepted_tokens) for r in plain]
    assert eng.prefix.stats.hit_tokens == 2 * BS * (len(prompts) - 1)  # blocks 0-1, not block 2
