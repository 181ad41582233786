"""When the public kernel functions take their Triton path and when their torch reference.

Each kernel module (`norm`, `rotary`, `activation`) exposes `f_triton` (the launcher), `f_ref`
(plain torch, bit-for-bit today's model code) and `f`, which asks `use_triton` here. The
Triton path is taken only for CUDA tensors with no autograd to record (the kernels have no
backward), and never inside `reference_kernels()`, which exists to compare both on a GPU.
The switch is one module-level flag: not thread-local, so flip it outside of serving.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

_triton_enabled = True
_triton_on_cpu = False
_mode = threading.local()  # per thread: a prefill loop and a decode loop may share a process


def use_triton(*tensors: torch.Tensor) -> bool:
    """True when every tensor is on CUDA (or `triton_on_cpu()` is on), Triton kernels are on,
    and autograd is not needed."""
    if not _triton_enabled or not (_triton_on_cpu or all(t.is_cuda for t in tensors)):
        return False
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))


@contextmanager
def triton_on_cpu() -> Iterator[None]:
    """Within it, the public kernel functions take their Triton path on CPU tensors too: for
    tests under Triton's interpreter (TRITON_INTERPRET=1), which runs the whole engine path."""
    global _triton_on_cpu
    before, _triton_on_cpu = _triton_on_cpu, True
    try:
        yield
    finally:
        _triton_on_cpu = before


@contextmanager
def reference_kernels() -> Iterator[None]:
    """Within it, every public kernel function runs its torch reference."""
    global _triton_enabled
    before, _triton_enabled = _triton_enabled, False
    try:
        yield
    finally:
        _triton_enabled = before


def invariant() -> bool:
    """Whether this thread runs batch-invariant kernels (`batch_invariant()`)."""
    return getattr(_mode, "invariant", False)


@contextmanager
def batch_invariant(on: bool = True) -> Iterator[None]:
    """Within it (this thread only), ops whose reduction order could depend on how many rows
    or query tokens share a launch take a path where it cannot: a row's result is then the
    same alone, in any batch, and as one of k+1 verify tokens (the `--deterministic` mode)."""
    before, _mode.invariant = invariant(), on
    try:
        yield
    finally:
        _mode.invariant = before


VERIFY_ROWS = 4
"""Rows a sequence a decode step's tiles are sized for, whatever the step has: those of a verify of
k = 3 drafts, so that a plain step and a verify run the same compiled kernels (a verify of more
rows takes more tiles of that size)."""


def rows_per_sequence() -> int | None:
    """Rows of a launch that belong to one sequence within `rows_a_sequence` (a decode step's target
    forward: 1 in a plain step, k + 1 in a verify); None outside one."""
    return getattr(_mode, "per_sequence", None)


def sequences(m: int) -> int:
    """The sequences behind a launch of m rows: what a launch's kernel configuration follows, so
    that a verify row of a batch runs the configuration (and gets the bits) of the plain step of
    the same batch."""
    q = rows_per_sequence()
    return m if q is None else max(1, m // q)


@contextmanager
def rows_a_sequence(q: int) -> Iterator[None]:
    """Within it (this thread only), a launch's rows come q to a sequence: a decode step's target
    forward (q = 1 in a plain step, k + 1 in a verify of k drafts). Kernels then take their
    configuration by sequences, so that greedy MTP gives plain decoding's answers in bf16 too."""
    before, _mode.per_sequence = getattr(_mode, "per_sequence", None), max(1, q)
    try:
        yield
    finally:
        _mode.per_sequence = before
