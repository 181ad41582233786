"""n > 1: several choices from one prompt, its KV computed once and its blocks shared.

A request of n choices is one Request (choice 0, which is prefilled as any request is) holding
n - 1 children. At admission every choice gets a slot and its KV room for its whole life, but
the children's first `shared` blocks are choice 0's own (reference-counted:
`BlockManager.allocate_after`), `shared` = the prompt's full blocks before the block holding its
last token, the blocks the prefix cache would share; each child's other blocks are its own.
When choice 0's prompt is computed (its KV landed, on a decode node) the children are forked
(`fork_no_sync`): the block holding the prompt's last token is copied into each child's own
(a device copy, stream-ordered), and each child joins the decode batch one token back, at the
prompt's last token: its first decode step recomputes that position into its own block and
samples its first token at the position choice 0's came from, with its own seed. So:

  * the prompt is prefilled once (once pushed over the wire in PD: the decode node forks);
  * each child's MTP layer has its own KV at the last prompt position (it depends on the token
    after it, which differs per choice), so its drafts are as good as choice 0's;
  * choice 0's first token comes from the prefill (the first-token message in PD), the others'
    one decode step later; a child's drafts for its first step are a fixed token (with a one-hot
    draft distribution), which verification handles exactly like any other draft.

Seeds: choice i samples with `choice_seed(seed, i)` (choice 0 with the request's own), so a
seeded request gives n different choices, the same on every run and in every mode. Without MTP a
choice's tokens are exactly a lone request's with its seed (the noise is keyed by seed and
position); with MTP its first step's drafts differ from a lone request's, so its draws do too
(from the same distribution).

Careful: the copy reads choice 0's block after the host may have freed it (choice 0 can end at
its first token); `DecodeBatch.hold_no_sync` keeps a reference on it until the copy has run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.cache.kv_cache import BlockManager
from engine.request import Request

if TYPE_CHECKING:
    from engine.sched.decode_batch import DecodeBatch

_MASK63 = (1 << 63) - 1


def choice_id(group: str, index: int) -> str:
    """A choice's own request id: the request's for choice 0, `{id}#{i}` for the others."""
    return group if index == 0 else f"{group}#{index}"


def choice_seed(seed: int, index: int) -> int:
    """Choice `index`'s seed: the request's for choice 0, a fixed 63-bit mix of (seed, index) else."""
    if index == 0:
        return seed
    x = (seed ^ (index * 0x9E3779B97F4A7C15)) & ((1 << 64) - 1)
    for shift, mul in ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB)):  # splitmix64's finalizer
        x = ((x ^ (x >> shift)) * mul) & ((1 << 64) - 1)
    return (x ^ (x >> 31)) & _MASK63


def shared_blocks(prompt_len: int, block_size: int) -> int:
    """Blocks the children share with choice 0: the prompt's full blocks before its last token's."""
    return (prompt_len - 1) // block_size


def make_children(parent: Request) -> list[Request]:
    """Choices 1..n-1 of `parent` (no blocks or slots yet)."""
    return [Request(choice_id(parent.request_id, i), parent.prompt, parent.params, choice_seed(parent.seed, i),
                    parent.stop_ids, parent.max_tokens, parent.num_prompt_tokens, index=i, group=parent.request_id)
            for i in range(1, parent.params.n)]


def group_fits(blocks: BlockManager, cached: list[int], need: int, n: int, shared: int) -> bool:
    """Whether n choices of `need` blocks each fit, choice 0 after its `cached` prefix and the
    others sharing its first `shared` blocks."""
    return blocks.can_allocate(cached, need - len(cached) + (n - 1) * (need - shared))


def allocate_children(blocks: BlockManager, parent: Request, need: int, block_size: int) -> None:
    """The children's blocks (choice 0 holds its own already): its shared prefix, then their own."""
    shared = shared_blocks(parent.num_prompt_tokens, block_size)
    for child in parent.children:
        child.block_ids = blocks.allocate_after(parent.block_ids[:shared], need - shared)


def fork_no_sync(batch: DecodeBatch, parent: Request) -> None:
    """Copy the last prompt block into each child's own and insert the children into `batch`
    (module docstring). Call when choice 0's prompt KV is complete, before it may end."""
    kids = [c for c in parent.children if not c.finished]
    parent.forked = True
    if not kids:
        return
    last = parent.num_prompt_tokens - 1
    col = last // batch.blocks.block_size
    copy_block_no_sync(batch.runner.kv.layers, parent.block_ids[col], [c.block_ids[col] for c in kids])
    batch.hold_no_sync([parent.block_ids[col]])
    k, vocab = batch.runner.k, batch.runner.state.vocab
    for child in kids:
        probs = None
        if k and not child.params.greedy:  # the fixed drafts' distribution: one-hot at token 0
            probs = torch.zeros(k, vocab, device=batch.runner.device)
            probs[:, 0] = 1.0
        batch.insert(child, parent.prompt[last], [0] * k if k else None, probs, seq_len=last)


def copy_block_no_sync(layers: list[torch.Tensor], src: int, dsts: list[int]) -> None:
    """Block `src` into blocks `dsts`, every layer ([2, blocks, block_size, heads, dim] each)."""
    index = torch.tensor(dsts, dtype=torch.long)
    if layers and layers[0].device.type == "cuda":
        index = index.pin_memory().to(layers[0].device, non_blocking=True)
    for layer in layers:
        layer.index_copy_(1, index, layer[:, src : src + 1].expand(-1, len(dsts), -1, -1, -1).contiguous())
