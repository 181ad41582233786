"""The Triton paged-attention kernel against its torch reference, on CUDA when there is one and
otherwise on the CPU through the Triton interpreter (small shapes: it runs numpy per program)."""

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

import kernels.paged_attention as pa
from kernels._dispatch import triton_on_cpu

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the interpreter (tests/conftest.py)

TOLERANCE = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=5e-3, rtol=5e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}


@dataclass
class Batch:
    q: torch.Tensor
    kv_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start: torch.Tensor
    max_q: int

    @property
    def scale(self) -> float:
        return self.q.shape[-1] ** -0.5

    def run(self, fn, num_splits: int = 1) -> torch.Tensor:
        return fn(self.q, self.kv_cache, self.block_tables, self.seq_lens, self.query_start,
                  self.max_q, self.scale, num_splits)


def make_batch(
    seq_lens: list[int],
    q_lens: list[int],
    *,
    group: int = 2,
    num_kv_heads: int = 2,
    head_dim: int = 32,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    cache_dtype: torch.dtype | None = None,
    pad_columns: int = 1,
    trash: float | None = None,
    max_q: int | None = None,
    seed: int = 0,
) -> Batch:
    """Rows' blocks drawn from a shuffled pool of ids (block 0 left as trash, a few blocks
    unused); tables padded with block 0; q a column slice of a fused qkv buffer."""
    gen = torch.Generator().manual_seed(seed)
    blocks = [-(-s // block_size) for s in seq_lens]
    num_blocks = 1 + sum(blocks) + 3
    ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    table = torch.zeros(len(seq_lens), max(blocks, default=0) + pad_columns, dtype=torch.int64)
    for row, n in enumerate(blocks):
        table[row, :n] = torch.tensor(ids[:n], dtype=torch.int64)
        ids = ids[n:]
    kv = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    if trash is not None:
        kv[:, 0] = trash
    num_q_heads = group * num_kv_heads
    qkv = torch.randn(sum(q_lens), (num_q_heads + 2 * num_kv_heads) * head_dim, generator=gen)
    q = qkv.to(DEVICE, dtype)[:, : num_q_heads * head_dim].view(-1, num_q_heads, head_dim)
    return Batch(
        q=q,
        kv_cache=kv.to(DEVICE, cache_dtype or dtype),
        block_tables=table.to(DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=DEVICE),
        query_start=torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], device=DEVICE),
        max_q=max_q if max_q is not None else max(q_lens),
    )


def assert_kernel_matches_reference(batch: Batch, num_splits: int = 1) -> torch.Tensor:
    out = batch.run(pa.paged_attention_triton, num_splits)
    ref = batch.run(pa.paged_attention_ref)
    assert out.shape == batch.q.shape and out.dtype == batch.q.dtype and out.is_contiguous()
    torch.testing.assert_close(out.float(), ref.float(), **TOLERANCE[batch.q.dtype])
    return out


BOUNDARY_SEQ_LENS = [16, 17, 15, 32, 33, 31, 1, 48]  # multiples of block_size 16, one past, one short


@pytest.mark.parametrize("group", [1, 3, 4, 8])
def test_decode_matches_reference_at_block_boundaries(group):
    batch = make_batch(BOUNDARY_SEQ_LENS, [1] * len(BOUNDARY_SEQ_LENS), group=group, head_dim=16)
    assert_kernel_matches_reference(batch)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_matches_reference_in_16_bit(dtype):
    batch = make_batch(BOUNDARY_SEQ_LENS, [1] * len(BOUNDARY_SEQ_LENS), group=4, dtype=dtype)
    assert_kernel_matches_reference(batch)


@pytest.mark.parametrize("k", [0, 1, 2, 3, 4])
def test_verify_block_of_k_plus_1_matches_reference(k):
    seq_lens = [k + 1 + 15, 40, 64, k + 1]
    batch = make_batch(seq_lens, [k + 1] * len(seq_lens), group=4, num_kv_heads=1)
    assert_kernel_matches_reference(batch)


def test_queries_ignore_keys_after_their_position():
    batch = make_batch([40], [4], group=2)
    before = batch.run(pa.paged_attention_triton)
    # keys at positions 37..39 are visible only to queries 1..3 (query 0 sits at 36)
    for pos in range(37, 40):
        block = batch.block_tables[0, pos // 16]
        batch.kv_cache[:, block, pos % 16] += 1.0
    after = batch.run(pa.paged_attention_triton)
    torch.testing.assert_close(after[0], before[0], atol=0, rtol=0)
    assert (after[1:] - before[1:]).abs().amax(dim=(1, 2)).min() > 1e-3


@pytest.mark.parametrize("group", [1, 8])
def test_prefill_chunk_sees_cached_prefix(group):
    # group 8 packs 16 queries per tile: the 40-token chunk spans three query tiles
    batch = make_batch([90, 50, 37], [40, 17, 37], group=group, num_kv_heads=1, head_dim=16)
    assert_kernel_matches_reference(batch)


def test_prefill_without_prefix_is_causal_over_the_chunk():
    batch = make_batch([1, 20, 64], [1, 20, 64], group=3, num_kv_heads=1, head_dim=16)
    assert_kernel_matches_reference(batch)


def test_rows_without_queries_produce_nothing():
    batch = make_batch([30, 20, 10, 5, 0], [0, 3, 0, 1, 0], group=2)
    assert_kernel_matches_reference(batch)


@pytest.mark.parametrize("num_splits", [1, 2, 3, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_kv_matches_reference(num_splits, dtype):
    # 16 splits exceed every row's key tiles: most splits write neutral partials
    # 66 / 4: the last query's keys open a tile the first query's do not (shares follow the first)
    seq_lens, q_lens = [1, 15, 16, 17, 70, 99, 30, 66], [1, 1, 2, 3, 5, 1, 20, 4]
    batch = make_batch(seq_lens, q_lens, group=4, num_kv_heads=1, head_dim=16, dtype=dtype)
    assert_kernel_matches_reference(batch, num_splits)


def test_split_kv_agrees_with_single_pass():
    batch = make_batch([70, 99, 33], [1, 3, 2], group=2, head_dim=16)
    one = batch.run(pa.paged_attention_triton, 1)
    torch.testing.assert_close(batch.run(pa.paged_attention_triton, 3), one, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_splits", [1, 2])
def test_padded_tables_never_read_trash_contents(num_splits):
    batch = make_batch([17, 33, 64], [1, 2, 5], pad_columns=3, trash=float("nan"))
    out = assert_kernel_matches_reference(batch, num_splits)
    assert torch.isfinite(out).all()


def test_all_trash_row_with_seq_len_equal_q_len_leaves_other_rows_alone():
    # a CUDA-graph padding row: every table entry is block 0, seq_len == q_len
    padded = make_batch([40, 25, 3], [1, 3, 3], head_dim=16)
    padded.block_tables[2] = 0
    out = assert_kernel_matches_reference(padded)
    real = Batch(padded.q[:4], padded.kv_cache, padded.block_tables[:2], padded.seq_lens[:2],
                 padded.query_start[:3], 3)
    torch.testing.assert_close(out[:4], real.run(pa.paged_attention_triton), atol=0, rtol=0)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("block_size", [8, 32, 64])
def test_other_cache_block_sizes(block_size):
    seq_lens = [block_size, block_size + 1, 2 * block_size - 1, 3]
    batch = make_batch(seq_lens, [1, 2, 3, 3], group=2, head_dim=16, block_size=block_size)
    assert_kernel_matches_reference(batch, num_splits=2)


def test_int32_block_tables_are_accepted():
    batch = make_batch([17, 50], [1, 4], head_dim=16)
    batch.block_tables = batch.block_tables.int()
    assert_kernel_matches_reference(batch)


@pytest.mark.parametrize(("dtype", "cache_dtype"), [(torch.float32, torch.bfloat16),
                                                    (torch.bfloat16, torch.float16)])
def test_cache_dtype_may_differ_from_q(dtype, cache_dtype):
    batch = make_batch([17, 50], [1, 4], head_dim=16, dtype=dtype, cache_dtype=cache_dtype)
    assert_kernel_matches_reference(batch)


def test_max_q_larger_than_any_query():
    batch = make_batch([17, 50], [1, 4], group=8, num_kv_heads=1, head_dim=16, max_q=40)
    assert_kernel_matches_reference(batch)


def test_head_dim_outside_supported_set_is_rejected():
    batch = make_batch([5], [1], head_dim=16)
    batch.q = torch.zeros(1, 4, 24, device=DEVICE)
    with pytest.raises(AssertionError, match="head_dim 24"):
        batch.run(pa.paged_attention_triton)


def test_reference_matches_per_row_sdpa():
    batch = make_batch([90, 20, 5, 7], [40, 1, 0, 7], group=3, num_kv_heads=2, head_dim=16)
    got = batch.run(pa.paged_attention_ref)
    starts, block_size = batch.query_start.tolist(), batch.kv_cache.shape[2]
    for row, seq_len in enumerate(batch.seq_lens.tolist()):
        q = batch.q[starts[row] : starts[row + 1]].transpose(0, 1)  # [Hq, q_len, D]
        pos = torch.arange(seq_len, device=DEVICE)
        slots = batch.block_tables[row, pos // block_size], pos % block_size
        k, v = (batch.kv_cache[i][slots].transpose(0, 1) for i in (0, 1))  # [Hkv, S, D]
        q_pos = seq_len - q.shape[1] + torch.arange(q.shape[1], device=DEVICE)
        want = F.scaled_dot_product_attention(
            q, k.repeat_interleave(3, 0), v.repeat_interleave(3, 0),
            attn_mask=pos[None, :] <= q_pos[:, None], scale=batch.scale,
        )
        torch.testing.assert_close(got[starts[row] : starts[row + 1]], want.transpose(0, 1))


def test_public_entry_point_dispatches_on_device():
    batch = make_batch([17, 50], [1, 4], head_dim=16)
    expected = pa.paged_attention_triton if DEVICE == "cuda" else pa.paged_attention_ref
    assert torch.equal(batch.run(pa.paged_attention), batch.run(expected))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="MMA bits: needs CUDA")
def test_invariant_mode_gives_a_query_the_same_bits_in_prefill_verify_and_decode():
    """`--deterministic`: a query's output bits must not depend on the step that computes it (a
    prefill chunk, a k+1 verify window, a decode step), or a request that migrates (its tokens
    re-prefilled) leaves the tokens of one that did not. The kernel's tile shape then cannot
    follow max_q (its M rows and warps changed the MMA, and the bits, between forms)."""
    from kernels._dispatch import batch_invariant

    n = 192
    pre = make_batch([n], [n], group=3, num_kv_heads=3, head_dim=64, dtype=torch.bfloat16, seed=5)
    positions = list(range(n))

    def rows(q_len: int) -> Batch:
        starts = [max(0, p - q_len + 1) for p in positions]
        q = torch.cat([pre.q[s : p + 1] for s, p in zip(starts, positions, strict=True)])
        lens = [p + 1 - s for s, p in zip(starts, positions, strict=True)]
        return Batch(q, pre.kv_cache, pre.block_tables.expand(len(positions), -1).contiguous(),
                     torch.tensor([p + 1 for p in positions], device=DEVICE),
                     torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=DEVICE), q_len)

    with batch_invariant():
        whole = pre.run(pa.paged_attention_triton)[positions]
        decode = rows(1).run(pa.paged_attention_triton)
        verify = rows(4).run(pa.paged_attention_triton)
    last = verify.view(-1, *verify.shape[1:])[torch.tensor(rows(4).query_start[1:].tolist()) - 1]
    assert torch.equal(decode, whole), "decode and prefill bits differ"
    assert torch.equal(last, whole), "verify and prefill bits differ"


def rope_case(batch: Batch, done_row: int | None = None, seed: int = 5):
    """The step's raw k and v (views of a fused buffer), positions, rotary tables and slots for
    `batch`'s queries (the last q_len keys of each row); `done_row`'s tokens write the trash block."""
    from kernels.paged_attention import NewKV

    gen = torch.Generator().manual_seed(seed)
    t, hq, d = batch.q.shape
    hkv, bs = batch.kv_cache.shape[3], batch.kv_cache.shape[2]
    kv = torch.randn(t, 2 * hkv * d, generator=gen).to(DEVICE, batch.q.dtype)
    k, v = kv[:, : hkv * d].view(t, hkv, d), kv[:, hkv * d :].view(t, hkv, d)
    starts, lens = batch.query_start.tolist(), batch.seq_lens.tolist()
    pos, slots = [], []
    for r in range(len(lens)):
        for i in range(starts[r + 1] - starts[r]):
            p = lens[r] - (starts[r + 1] - starts[r]) + i
            pos.append(p)
            slots.append(i if r == done_row else int(batch.block_tables[r, p // bs]) * bs + p % bs)
    ang = torch.arange(max(lens) + 1).float()[:, None] * torch.rand(d // 2, generator=gen)[None, :]
    cos, sin = torch.cat([ang.cos()] * 2, -1).to(DEVICE), torch.cat([ang.sin()] * 2, -1).to(DEVICE)
    as_long = dict(dtype=torch.int64, device=DEVICE)
    return NewKV(k, v, torch.tensor(pos, **as_long), cos, sin, torch.tensor(slots, **as_long))


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize(("group", "q_lens", "lens"), [
    (1, [1, 1, 1], [130, 47, 65]), (3, [4, 2, 3], [130, 47, 65]), (4, [4, 4, 1], [130, 47, 65]),
    (2, [1, 1, 1], [300, 47, 257]),  # one query a row takes 128-key tiles: 3 tiles, a key just past an edge
    (2, [4, 4, 4], [130, 47, 258]),  # a verify whose last queries' keys open a tile its first query's do not
    (2, [1, 1, 0], [47, 65, 0]), (3, [4, 3, 0], [130, 65, 0]),  # a bucket's padding row: no queries, no keys
])
def test_rotary_and_kv_write_inside_the_kernel_equal_the_two_launches(group, q_lens, lens, num_splits):
    """Decode and verify steps: q rotated in the kernel, the step's keys rotated and written with
    their values by the programs whose share holds them (some share a key tile with older keys,
    some straddle two shares), then attended; against `rope_and_cache` + the kernel, outputs and
    cache alike. Row 1 is done: its tokens write the trash block."""
    from kernels.rotary import rope_and_cache

    batch = make_batch(lens, q_lens, group=group, seed=3)
    new = rope_case(batch, done_row=1)
    want_cache = batch.kv_cache.clone()
    q_rot = rope_and_cache(batch.q, new.k, new.v, new.positions, new.cos, new.sin, want_cache, new.slot_mapping)
    want = pa.paged_attention_triton(q_rot, want_cache, batch.block_tables, batch.seq_lens, batch.query_start,
                                     batch.max_q, batch.scale, num_splits)
    calls = []
    real = pa.paged_attention_triton
    with triton_on_cpu(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(pa, "paged_attention_triton", lambda *a: calls.append(a[-1] is not None) or real(*a))
        got = pa.paged_attention_rope(batch.q, new, batch.kv_cache, batch.block_tables, batch.seq_lens,
                                      batch.query_start, batch.max_q, batch.scale, num_splits)
    assert calls == [True]  # one launch, the step's keys written inside it
    torch.testing.assert_close(batch.kv_cache, want_cache, atol=0, rtol=0)
    live = torch.ones(got.shape[0], dtype=torch.bool)
    live[batch.query_start[1] : batch.query_start[2]] = False  # the done row reads keys nobody wrote
    torch.testing.assert_close(got[live], want[live], atol=1e-5, rtol=1e-5)


def test_rotary_inside_the_kernel_falls_back_to_two_launches_for_prefill_chunks():
    """A chunk longer than one query tile (64 queries at G = 2): the step's keys must be in the
    cache before any tile reads them, so the two launches run (same results either way)."""
    from kernels.rotary import rope_and_cache

    batch = make_batch([140, 70], [100, 30], group=2, seed=4)
    new = rope_case(batch)
    want_cache = batch.kv_cache.clone()
    q_rot = rope_and_cache(batch.q, new.k, new.v, new.positions, new.cos, new.sin, want_cache, new.slot_mapping)
    want = pa.paged_attention(q_rot, want_cache, batch.block_tables, batch.seq_lens, batch.query_start,
                              batch.max_q, batch.scale)
    calls = []
    real = pa.paged_attention_triton
    with triton_on_cpu(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(pa, "paged_attention_triton", lambda *a: calls.append(len(a) > 8 and a[8] is not None) or real(*a))
        got = pa.paged_attention_rope(batch.q, new, batch.kv_cache, batch.block_tables, batch.seq_lens,
                                      batch.query_start, batch.max_q, batch.scale)
    assert calls == [False]  # the rotary kernel, then the attention kernel over the cache
    torch.testing.assert_close(batch.kv_cache, want_cache, atol=0, rtol=0)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("rows", [1, 16, 64])
def test_a_decode_steps_tiles_are_the_same_for_one_query_a_row_and_a_verify(group, rows):
    """Greedy MTP gives plain decoding's answers only if a verify row sums its keys as a plain step
    does: the same tile shapes (another M or key tile is another compiled kernel)."""
    pre = rows <= pa.PRELOAD_KV_MAX_ROWS
    plain = pa._launch_tiles(1, group, 64, 16, True, pre)
    for k in (1, 2, 3):
        assert pa._launch_tiles(k + 1, group, 64, 16, True, pre) == plain
