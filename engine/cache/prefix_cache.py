"""Prefix caching: which leading KV blocks of a prompt are already computed, and reusing them.

Receives prompts (token ids) from a scheduler (the single-process engine, the prefill node);
hands back, at a request's start, its block list (the cached prefix's blocks, shared, then new
ones) and how many prompt tokens need no compute; after each prefill step it registers the
request's blocks whose KV is now complete. The BlockManager keeps the blocks, the references
and the LRU of evictable ones (engine/cache/kv_cache.py); this file decides what a block's key is.

A block's key is a hash chain: h_j = H(h_{j-1}, tokens of block j, lookahead tokens), seeded
with the model's identity (name, dtype, whether an MTP layer is cached). With an MTP layer
(k > 0) the lookahead is the one token after the block: the MTP layer's KV at position p reads
the token at p + 1, so the block's last position depends on the next block's first token.

Only blocks strictly before the prompt's last token are cached or reused: the last token is
always computed (its logits give the first token), and decode never writes into such a block.
Sampling, logprobs and drafts only read the KV, so greedy output is the same with a cache hit.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from engine.cache.kv_cache import BlockManager


def block_hashes(prompt: list[int], block_size: int, seed: bytes, lookahead: int) -> list[bytes]:
    """Hash chain of the prompt's cacheable blocks: those ending before its last token."""
    out: list[bytes] = []
    prev = seed
    for j in range((len(prompt) - 1) // block_size):
        end = (j + 1) * block_size
        tokens = prompt[j * block_size : end + lookahead]
        h = hashlib.blake2b(prev, digest_size=16)
        h.update(b"".join(t.to_bytes(4, "little") for t in tokens))
        prev = h.digest()
        out.append(prev)
    return out


@dataclass
class PrefixStats:
    """Cumulative lookups: requests started and prompt tokens asked, and how many hit the cache."""

    requests: int = 0
    hit_requests: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0

    def record(self, prompt_len: int, hit_tokens: int) -> None:
        self.requests += 1
        self.hit_requests += hit_tokens > 0
        self.query_tokens += prompt_len
        self.hit_tokens += hit_tokens

    def as_dict(self) -> dict[str, int]:
        return {"prefix_requests": self.requests, "prefix_hit_requests": self.hit_requests,
                "prefix_query_tokens": self.query_tokens, "prefix_hit_tokens": self.hit_tokens}


class PrefixCache:
    """A scheduler's prefix-cache view over its BlockManager. `enabled=False` caches nothing
    (every call still works, so schedulers have one path)."""

    def __init__(self, blocks: BlockManager, model_id: str, lookahead: int, enabled: bool) -> None:
        self.blocks, self.lookahead, self.enabled = blocks, lookahead, enabled
        self.seed = hashlib.blake2b(f"{model_id}|lookahead={lookahead}".encode(), digest_size=16).digest()
        self.stats = PrefixStats()

    def hashes(self, prompt: list[int], computes_prompt: bool = False) -> list[bytes]:
        """The prompt's block keys; none (no hit, nothing cached) when `computes_prompt`: a request
        that asked for prompt logprobs computes every position (as vLLM skips the cache for it)."""
        if not self.enabled or computes_prompt:
            return []
        return block_hashes(prompt, self.blocks.block_size, self.seed, self.lookahead)

    def fits(self, hashes: list[bytes], need: int) -> bool:
        """Whether `allocate` of `need` blocks for a prompt of these hashes would succeed now."""
        cached = self.blocks.match(hashes)
        return self.blocks.can_allocate(cached, need - len(cached))

    def allocate(self, prompt: list[int], hashes: list[bytes], need: int) -> tuple[list[int], int] | None:
        """`need` blocks for `prompt` with its longest cached prefix first, and the number of
        tokens those hold; None (nothing taken) when the free blocks do not suffice."""
        cached = self.blocks.match(hashes)
        if not self.blocks.can_allocate(cached, need - len(cached)):
            return None
        block_ids = self.blocks.allocate_after(cached, need - len(cached))
        hit = len(cached) * self.blocks.block_size
        if self.enabled:
            self.stats.record(len(prompt), hit)
        return block_ids, hit

    def register(self, block_ids: list[int], hashes: list[bytes], num_computed: int) -> None:
        """Cache the blocks whose KV is complete once `num_computed` prompt tokens are computed."""
        for j in range(min(len(hashes), num_computed // self.blocks.block_size)):
            self.blocks.register(block_ids[j], hashes[j])

    def status(self) -> dict[str, int]:
        return {**self.stats.as_dict(), "cached_blocks": self.blocks.num_cached,
                "evicted_blocks": self.blocks.evictions, "shared_blocks": self.blocks.num_shared}
