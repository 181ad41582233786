"""What a decode step launches besides the model's own kernels, counted on the CPU: the engine's
step under Triton's interpreter, with torch's ops recorded by a dispatch mode outside the Triton
launches. Gathers, cats and index arithmetic around the model each cost a kernel launch in the
step's CUDA graph (issue 30); the step reads the batch state through one kernel
(`step_inputs`), and what is left of torch's own ops besides the model's GEMMs and embedding is
the MTP's pick of each row's last hidden and the drafts' write into the state."""

from __future__ import annotations

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from triton.runtime.interpreter import InterpretedFunction

from engine.engine import EngineConfig, LLMEngine
from engine.model.llama import fuse_projections
from engine.model.loader import load_model
from engine.sampling.sampling_params import SamplingParams
from kernels._dispatch import triton_on_cpu

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="counts the interpreter's launches (CPU)")

NO_LAUNCH = {"view", "_unsafe_view", "reshape", "t", "transpose", "slice", "select", "unsqueeze", "squeeze", "split",
             "split_with_sizes", "expand", "empty", "empty_like", "empty_strided", "as_strided", "detach", "alias",
             "permute", "promote_types", "new_empty", "unbind"}
MODEL_OPS = {"mm", "embedding"}  # the model's plain GEMMs (cuBLAS without PDL) and its token embeddings


class TorchOps(TorchDispatchMode):
    """Counts the torch ops that launch a kernel, except inside a Triton launch (the interpreter's own)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()
        self.triton: collections.Counter[str] = collections.Counter()
        self.inside = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if not self.inside and name not in NO_LAUNCH | MODEL_OPS:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


def _count(k: int, monkeypatch) -> TorchOps:
    loaded = load_model("tiny", dtype="float32")
    fuse_projections(loaded.model)
    counts = TorchOps()
    real = InterpretedFunction.run

    def run(self, *a, **kw):
        counts.triton[self.fn.__name__] += 1
        counts.inside += 1
        try:
            return real(self, *a, **kw)
        finally:
            counts.inside -= 1

    with triton_on_cpu(), torch.no_grad():
        eng = LLMEngine(loaded, EngineConfig(num_speculative_tokens=k, block_size=8, attention_backend="triton"))
        for n in (9, 14):
            eng.add_request(list(range(5, 5 + n)), SamplingParams(max_tokens=20, ignore_eos=True))
        eng.step()
        eng.step()
        rows = torch.tensor(sorted(eng.batch.running))
        monkeypatch.setattr(InterpretedFunction, "run", run)
        with counts:
            eng.runner.decode_step(rows, (True, False, False, False), None, 0, eng.runner.max_blocks)
    return counts


@pytest.mark.parametrize("k,left", [(0, {}), (3, {"index": 1, "index_put_": 1})])
def test_a_greedy_step_gathers_the_batch_state_in_one_kernel(k, left, monkeypatch):
    counts = _count(k, monkeypatch)
    assert dict(counts.ops) == left
    assert counts.triton["_step_inputs_kernel"] == 1 and counts.triton["_tail_kernel"] == 1
    assert counts.triton["_uniform_meta_kernel"] == max(k - 1, 0)  # one per chained MTP step
