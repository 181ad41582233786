"""Out-of-bounds checks for kernels run by Triton's interpreter (TRITON_INTERPRET=1).

On a GPU a masked-in load a few bytes outside every allocation usually reads mapped memory and
goes unseen, until the caching allocator puts an allocation at the start of a segment and the
kernel faults (decode attention read up to 1920 bytes before the KV cache for rows with no keys:
an illegal address in one GPU test run, found by compute-sanitizer). The interpreter loads
through raw host addresses and checks nothing either.

`checked_addresses()` makes every load and store the interpreter runs check that each address
its mask lets through lies inside the storage of a tensor the launch was given (the whole
storage: a view may reach the rest of its base tensor, as the kernels' padding rows do).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
from triton.runtime import interpreter as interp

_launch = threading.local()  # the running launch's kernel name and storages [(start, end)]
_reachable: list[tuple[int, int]] = []  # storages kernels reach through address tables (`reachable`)


def _storages(args: list[Any], kwargs: dict[str, Any]) -> list[tuple[int, int]]:
    found: dict[int, int] = {}

    def visit(arg: Any) -> None:
        if isinstance(arg, tuple | list):
            for a in arg:
                visit(a)
        elif hasattr(arg, "untyped_storage"):
            s = arg.untyped_storage()
            found[s.data_ptr()] = s.data_ptr() + s.nbytes()
        elif hasattr(arg, "base") and hasattr(arg, "block_shape"):  # a host TensorDescriptor (TMA)
            visit(arg.base)

    for a in [*args, *kwargs.values()]:
        visit(a)
    return sorted(found.items())


def _check(ptrs: Any, mask: Any, what: str) -> None:
    ranges = getattr(_launch, "ranges", None)
    if ranges is None:
        return
    shape = np.broadcast(ptrs.data, mask.data).shape
    addrs = np.broadcast_to(ptrs.data, shape)[np.broadcast_to(mask.data, shape)].astype(np.uint64)
    if addrs.size == 0:
        return
    size = np.dtype(interp._get_np_dtype(ptrs.get_element_ty())).itemsize
    starts = np.array([lo for lo, _ in ranges], dtype=np.uint64)
    ends = np.array([hi for _, hi in ranges], dtype=np.uint64)
    at = np.searchsorted(starts, addrs, side="right") - 1
    ok = (at >= 0) & (addrs + np.uint64(size) <= ends[np.maximum(at, 0)])
    if not ok.all():
        bad = addrs[~ok]
        raise AssertionError(f"{_launch.kernel}: {what} of {bad.size} element(s) outside every argument's "
                             f"storage, e.g. at 0x{int(bad[0]):x} (storages: "
                             f"{[(hex(lo), hi - lo) for lo, hi in ranges]})")


@contextmanager
def reachable(*tensors: Any) -> Iterator[None]:
    """Within it, launches may also touch these tensors' storages: a kernel given their addresses
    in a table (kernels/block_copy.py) reaches memory that no argument names."""
    added = [(t.untyped_storage().data_ptr(), t.untyped_storage().data_ptr() + t.untyped_storage().nbytes())
             for t in tensors]
    _reachable.extend(added)
    try:
        yield
    finally:
        for r in added:
            _reachable.remove(r)


@contextmanager
def checked_addresses() -> Iterator[None]:
    """Within it, interpreted kernels fail on a masked-in load or store outside their arguments."""
    ex, builder = interp.GridExecutor, interp.InterpreterBuilder
    saved = (ex._init_args_hst, builder.create_masked_load, builder.create_masked_store)
    init_args, masked_load, masked_store = saved

    def init_args_hst(self: Any, args_dev: Any, kwargs: Any) -> Any:
        args_hst, kwargs_hst = init_args(self, args_dev, kwargs)
        _launch.kernel = getattr(self.fn, "__name__", "kernel")
        _launch.ranges = sorted(_storages(args_hst, kwargs_hst) + _reachable)
        return args_hst, kwargs_hst

    def load(self: Any, ptrs: Any, mask: Any, other: Any, *rest: Any, **kw: Any) -> Any:
        _check(ptrs, mask, "a load")
        return masked_load(self, ptrs, mask, other, *rest, **kw)

    def store(self: Any, ptrs: Any, value: Any, mask: Any, *rest: Any, **kw: Any) -> Any:
        _check(ptrs, mask, "a store")
        return masked_store(self, ptrs, value, mask, *rest, **kw)

    ex._init_args_hst, builder.create_masked_load, builder.create_masked_store = init_args_hst, load, store
    try:
        yield
    finally:
        ex._init_args_hst, builder.create_masked_load, builder.create_masked_store = saved
        _launch.ranges = None
