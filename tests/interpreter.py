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
