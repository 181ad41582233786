"""The prefill step's metadata kernel equals its torch reference and the meaning written in
kernels/prefill_meta.py, computed here from host lists: rows of any length (0 too), chunks
that start after a cached prefix, rows that end their prompt or not, padding tokens and rows."""

from __future__ import annotations

import random

import pytest
import torch

from kernels import _dispatch
from kernels.prefill_meta import prefill_meta, prefill_meta_ref

BS, W = 4, 6


def make_case(lens, starts, lasts, pad_tokens, pad_rows, seed=0):
    rng = random.Random(seed)
    n = sum(lens)
    ids = [rng.randrange(1, 1000) for _ in range(n)] + [0] * pad_tokens
    qs = [0]
    for q in lens:
        qs.append(qs[-1] + q)
    rows = len(lens) + pad_rows
    qs += [qs[-1]] * pad_rows
    tables = [rng.sample(range(1, 40), W) for _ in lens] + [[0] * W] * pad_rows
    row_next = [rng.randrange(1, 1000) for _ in lens] + [0] * pad_rows
    t = lambda x: torch.tensor(x, dtype=torch.long)  # noqa: E731
    args = (t(ids), t(qs), t(list(starts) + [0] * pad_rows), t(tables), t(row_next),
            t([int(x) for x in lasts] + [0] * pad_rows))
    return args, rows


def expected(args, rows):
    ids, qs, start, tables, row_next, is_last = (a.tolist() for a in args)
    t = len(ids)
    pos, slot, row, col, nxt = [0] * t, [i % BS for i in range(t)], [rows] * t, [0] * t, [0] * (t + 1)
    seq, last, put = [], [], []
    for r in range(rows):
        q = qs[r + 1] - qs[r]
        for j in range(q):
            i, p = qs[r] + j, start[r] + j
            pos[i], row[i], col[i] = p, r, j
            slot[i] = tables[r][min(p // BS, W - 1)] * BS + p % BS
            nxt[i] = ids[i + 1] if j < q - 1 else row_next[r]
        seq.append(start[r] + q)
        last.append(min(max(qs[r + 1] - 1, 0), t - 1))
        put.append(qs[r + 1] - 1 if is_last[r] else t)
    return pos, slot, row, col, nxt, seq, last, put


CASES = [
    ((5,), (0,), (True,), 0, 0),
    ((5, 1, 7), (0, 8, 3), (True, False, True), 3, 2),
    ((3, 0, 9), (2, 0, 0), (False, False, True), 20, 0),
    ((130,), (0,), (True,), 126, 1),  # more than one tile of a row and of the padding
]


@pytest.mark.parametrize("case", CASES)
def test_kernel_and_reference_equal_the_meaning(device, case):
    args, rows = make_case(*case)
    args = tuple(a.to(device) for a in args)
    want = expected(args, rows)
    with _dispatch.triton_on_cpu():
        got = prefill_meta(*args, BS)
    ref = prefill_meta_ref(*args, BS)
    for name, a, b, w in zip(got._fields, got, ref, want, strict=True):
        assert a.tolist() == w, name
        assert b.tolist() == w, name
