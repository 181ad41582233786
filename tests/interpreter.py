"""Triton's interpreter (TRITON_INTERPRET=1) with two of its fixed costs per op taken out, for the
test session; what it computes is unchanged.

- A @triton.jit function called from inside a kernel (a helper, or `tl.zeros`, `tl.sum`...) runs
  `_patch_lang` at every call: `inspect.getmembers` over triton.language, its tensor class and
  its math module, to swap in the interpreter's builtins. Those modules are patched already,
  by the launch (or by the first such call of the launch), so the call finds nothing left to
  swap, yet the walk was a fifth of an interpreted engine step. Here a launch patches each set
  of language modules once.
- `_get_np_dtype` builds its table of numpy dtypes at every call, several times per op; here a
  dtype's answer is kept.
- A `tl.reduce` with a combine function of its own (kernels/norm.py's `_add`) falls back to
  `ReduceOps.generic_reduce`, which calls the combine once per element, building tensors for
  each: most of an interpreted engine step. Here it calls the combine once per position along the
  reduced axis, on the whole slice of every other position at once. Each output element sees the
  same operations in the same order (the first element, then combine(acc, next) along the axis,
  the result cast back to the input's dtype), and the combine is elementwise (Triton applies it
  per element), so every bit of the result is unchanged.

`install()` leaves the interpreter as it is where it lacks one of the functions wrapped here.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

_launch = threading.local()  # ids of the language modules the running launch has patched


def _language_modules(fn: Any) -> frozenset[int]:
    import triton.language as tl

    return frozenset(id(v) for v in fn.__globals__.values() if v is tl or v is tl.core)


def install() -> None:
    from triton.runtime import interpreter as interp

    wrapped = ("_patch_lang", "_get_np_dtype", "_LangPatchScope")
    if not all(hasattr(interp, name) for name in wrapped) or getattr(interp, "_pdserve_fast", False):
        return
    interp._pdserve_fast = True
    launch, patch_lang, np_dtype = interp.GridExecutor.__call__, interp._patch_lang, interp._get_np_dtype

    @functools.wraps(launch)
    def run_launch(self: Any, *args: Any, **kwargs: Any) -> Any:
        outer, _launch.patched = getattr(_launch, "patched", None), frozenset()
        try:
            return launch(self, *args, **kwargs)
        finally:
            _launch.patched = outer

    @functools.wraps(patch_lang)
    def patch_lang_once(fn: Any) -> Any:
        patched, modules = getattr(_launch, "patched", None), _language_modules(fn)
        if patched is not None and modules <= patched:
            return interp._LangPatchScope()  # nothing to restore: the launch's own scope does
        if patched is not None:
            _launch.patched = patched | modules
        return patch_lang(fn)

    import triton.language as tl

    cache: dict[Any, Any] = {}

    @functools.wraps(np_dtype)
    def np_dtype_kept(tt_dtype: Any) -> Any:
        key = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
        if isinstance(key, tl.pointer_type):  # unhashable; always uint64
            return np_dtype(tt_dtype)
        if key not in cache:
            cache[key] = np_dtype(tt_dtype)
        return cache[key]

    interp.GridExecutor.__call__ = run_launch
    interp._patch_lang = patch_lang_once
    interp._get_np_dtype = np_dtype_kept
    if hasattr(interp, "ReduceOps") and all(hasattr(interp.ReduceOps, n) for n in ("generic_reduce", "unravel")):
        per_element.append(interp.ReduceOps.generic_reduce)
        interp.ReduceOps.generic_reduce = _reduce_by_slices


per_element: list[Any] = []  # the interpreter's own generic_reduce, once install() has replaced it


def _reduce_by_slices(self: Any, input: tuple[Any, ...]) -> list[Any]:
    """`ReduceOps.generic_reduce` (a combine of the kernel's own along `self.axis`, or over
    everything when it is None), one combine call per position along the axis."""
    import numpy as np
    import triton.language as tl

    original_axis = self.axis
    input, axis = self.unravel(input, self.axis)
    data = [arg.handle.data for arg in input]
    acc = [np.take(d, 0, axis=axis) for d in data]
    for i in range(1, data[0].shape[axis]):
        left = [self.to_tensor(a, arg.dtype) for a, arg in zip(acc, input, strict=True)]
        right = [self.to_tensor(np.take(d, i, axis=axis), arg.dtype) for d, arg in zip(data, input, strict=True)]
        out = self.combine_fn.fn(*left, *right)
        out = out if isinstance(out, tuple) else (out,)
        acc = [np.asarray(o.handle.data if isinstance(o, tl.core.tensor) else o).astype(a.dtype).reshape(a.shape)
               for o, a in zip(out, acc, strict=True)]
    ret = []
    for a, arg in zip(acc, input, strict=True):
        if self.keep_dims:
            a = np.expand_dims(a, axis) if original_axis is not None else a.reshape((1,) * data[0].ndim)
        elif original_axis is None:
            a = a.item()
        ret.append(self.to_tensor(a, arg.dtype))
    return ret
