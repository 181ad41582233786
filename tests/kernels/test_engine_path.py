"""The engine on the fast path's kernels (Triton attention backend, fused projections, every
kernel's Triton launcher; under the interpreter on CPU) gives the torch reference's greedy
tokens and logprobs, penalized or grammar-constrained requests beside plain ones included: the
kernels are wired to the right tensors, not only right alone."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.engine import EngineConfig, LLMEngine
from engine.grammar.structured import StructuredSpec
from engine.model.llama import CausalLM, fuse_projections
from engine.model.loader import load_model
from engine.runner.cuda_graphs import MAX_TOP_LOGPROBS, DecodeGraphs
from engine.runner.prefill_graphs import PrefillGraphs
from engine.sampling.sampling_params import SamplingParams
from kernels._dispatch import triton_on_cpu

pytestmark = pytest.mark.skipif(torch.cuda.is_available(),
                                reason="CPU interpreter check; on a GPU tests/engine/test_gpu.py runs the compiled path")

PROMPTS = [[5, 6, 7], list(range(10, 31)), [9] * 17]  # 21 and 17 tokens cross block boundaries
# With 8 output tokens every request's decode crosses a block boundary of 8 too (3, 21 and 17
# tokens grow past 8, 24 and 24); each step is many interpreted launches, so no more.
MAX_TOKENS = 8


PENALIZED = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=3, repetition_penalty=1.4,
                           frequency_penalty=0.7, logit_bias=((65, 3.0),))
CONSTRAINED = SamplingParams(max_tokens=MAX_TOKENS, logprobs=3, structured=StructuredSpec("regex", "[a-f]{3}-[0-9]+"))


@pytest.mark.parametrize("k,middle", [(0, None), (3, None), (2, PENALIZED), (3, CONSTRAINED)])
def test_triton_path_equals_reference_greedy_with_logprobs(k, middle):
    """Decode steps and the MTP chain rotate q and k and write the step's K/V inside the attention
    kernel; prefill takes the rotary kernel, then the paged kernel."""
    params: SamplingParams | list[SamplingParams] = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=3)
    if middle is not None:  # the middle request penalized or constrained, its neighbours not
        params = [params, middle, params]
    ref = LLMEngine(load_model("tiny", dtype="float32"), EngineConfig(num_speculative_tokens=k, block_size=8))
    want = ref.generate(PROMPTS, params)
    loaded = load_model("tiny", dtype="float32")
    fuse_projections(loaded.model)
    with triton_on_cpu():
        fast = LLMEngine(loaded, EngineConfig(num_speculative_tokens=k, block_size=8, attention_backend="triton",
                                              block_shuffle_seed=5))
        got = fast.generate(PROMPTS, params)
    assert [r.output_ids for r in got] == [r.output_ids for r in want]
    for a, b in zip(got, want, strict=True):
        assert [lp.logprob for lp in a.logprobs] == pytest.approx([lp.logprob for lp in b.logprobs], abs=1e-4)
        assert [lp.top for lp in a.logprobs][0][0][0] == [lp.top for lp in b.logprobs][0][0][0]
    assert fast.num_free_blocks == fast.blocks.capacity


def test_folded_norms_leave_one_norm_kernel_a_forward(monkeypatch):
    """With the norms folded, each residual GEMM leaves its rows' sums of squares for the next q/k/v
    or gate/up GEMM, which normalizes x itself, and so does the embedding gather
    (`embed_with_sumsq`) for the first layer's: a forward runs the final norm's kernel only (2 L + 1
    without `fuse_projections`), and the tokens are the unfused model's."""
    from kernels import norm as norm_mod

    calls: list[int] = []
    real = norm_mod.add_rms_norm_triton
    monkeypatch.setattr(norm_mod, "add_rms_norm_triton", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    counts, layers, tokens = {}, 0, {}
    for fused in (False, True):
        loaded = load_model("tiny", dtype="float32")
        layers = loaded.model.config.num_hidden_layers
        if fused:
            fuse_projections(loaded.model)
        with triton_on_cpu():
            eng = LLMEngine(loaded, EngineConfig(num_speculative_tokens=0, block_size=8, attention_backend="triton"))
            calls.clear()
            out = eng.generate([[5, 6, 7]], SamplingParams(max_tokens=5, ignore_eos=True))
        counts[fused], tokens[fused] = len(calls), out[0].output_ids
    forwards = 5  # the prefill and 4 decode steps
    assert counts == {False: forwards * (2 * layers + 1), True: forwards}
    assert tokens[True] == tokens[False]


def test_the_mtp_input_takes_one_launch_and_its_block_norm_none(monkeypatch):
    """An MTP forward gathers the embedding and runs enorm and hnorm in one kernel (`mtp_input`),
    and eh_proj leaves its rows' sums of squares, so the block's folded input norm runs inside its
    q/k/v GEMM: no norm kernel runs inside an MTP forward, and the tokens are the reference's."""
    import engine.model.llama as model_mod
    from kernels import norm as norm_mod

    norms: list[int] = []
    inputs: list[int] = []
    inside: list[int] = []  # norm kernels launched by each MTP forward
    real_norm, real_input, real_mtp = norm_mod.add_rms_norm_triton, model_mod.mtp_input, CausalLM.mtp_forward

    def mtp_forward(self, *a, **kw):
        before = len(norms)
        out = real_mtp(self, *a, **kw)
        inside.append(len(norms) - before)
        return out

    monkeypatch.setattr(norm_mod, "add_rms_norm_triton", lambda *a, **kw: norms.append(1) or real_norm(*a, **kw))
    monkeypatch.setattr(model_mod, "mtp_input", lambda *a, **kw: inputs.append(1) or real_input(*a, **kw))
    monkeypatch.setattr(CausalLM, "mtp_forward", mtp_forward)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    want = LLMEngine(load_model("tiny", dtype="float32"), EngineConfig(num_speculative_tokens=2, block_size=8))
    want_ids = want.generate([[5, 6, 7]], params)[0].output_ids
    loaded = load_model("tiny", dtype="float32")
    fuse_projections(loaded.model)
    with triton_on_cpu():
        eng = LLMEngine(loaded, EngineConfig(num_speculative_tokens=2, block_size=8, attention_backend="triton"))
        inside.clear(), inputs.clear()
        out = eng.generate([[5, 6, 7]], params)
    assert inputs and len(inputs) == len(inside) and not any(inside)
    assert out[0].output_ids == want_ids


def reference(k: int) -> LLMEngine:
    """The torch reference engine (fp32, CPU)."""
    return LLMEngine(load_model("tiny", dtype="float32"), EngineConfig(num_speculative_tokens=k, block_size=8))


class EagerGraphs(DecodeGraphs):
    """engine/runner/cuda_graphs.py's DecodeGraphs with each replay run eagerly (no CUDA on the CPU): the
    same buckets, block-table widths and spare-slot padding rows, so the graph path's steps run
    under the interpreter (and its address checks, tests/kernels/bounds.py). `keys`: (rows, key)
    of every step."""

    def __init__(self, runner, max_batch: int) -> None:
        super().__init__(runner, max_batch)
        self.keys: list = []

    def replay(self, slots, flags, logprobs, num_kv_blocks, k=None):
        rows, width = self._padded(slots, flags, logprobs, num_kv_blocks)
        return self.runner.decode_step(rows, flags, slice(None) if logprobs else None, MAX_TOP_LOGPROBS, width, k)

    def replay_forward(self, slots, flags, logprobs, num_kv_blocks):
        rows, width = self._padded(slots, flags, logprobs, num_kv_blocks)
        self._fwd = (rows, width, self.runner.decode_forward(rows, flags, width, None, logprobs))

    def replay_finish(self, n, flags, logprobs, num_kv_blocks):
        rows, width, fwd = self._fwd
        return self.runner.decode_finish(fwd, rows, flags, slice(None) if logprobs else None, MAX_TOP_LOGPROBS, width)

    def _padded(self, slots, flags, logprobs, num_kv_blocks):
        """The padded rows the key's graph would read (its buffers made, as a capture makes them), and its width."""
        key = self.key(len(slots), flags, logprobs, num_kv_blocks)
        self._prepare(key)
        self._place(slots, key)
        self.keys.append((len(slots), key))
        return self.runner.state.step_rows[: key[0]], key[-1]


# rows that fit 5 blocks of 8 tokens over their whole reservation (prompt + max_tokens + room), and
# two wide ones that finish first: 5 rows (bucket 8, wide), 4 (bucket 4, wide), then 3 (bucket 4, narrow)
LENGTHS = [(3, 12), (10, 10), (12, 6), (40, 4), (35, 2)]  # (prompt tokens, max_tokens)


def padded_run(k: int, prompts: list[list[int]], params: SamplingParams | list[SamplingParams], monkeypatch,
               policy=None, want=None):
    """`prompts` through the graphs' steps run eagerly at their buckets' sizes (rope in attention,
    narrow table width 5 blocks): prefill packs the prompts into a token x row bucket (padding rows
    have no tokens and no keys; PrefillGraphs deferring, never capturing), decode pads a batch to its
    bucket with the spare slot (EagerGraphs). Checks the reference's tokens and logprobs and that
    every block comes back; returns the decode graphs' (rows, key) list and the prefill keys. `policy`:
    adaptive k's (engine/spec_decode/adaptive_k.py) for the fast engine, which then steps at k and 0. `want`: the
    reference's requests, when the caller ran it."""
    if want is None:
        want = reference(k).generate(prompts, params)
    loaded = load_model("tiny", dtype="float32")
    fuse_projections(loaded.model)
    with triton_on_cpu():
        # max_model_len 128: the wide table is 17 blocks, attended in 3 key splits (shares with no
        # keys and the combine launch, as in tiny's default 129 blocks and 17 splits, at a fraction
        # of the interpreted programs); the narrow one (5 blocks) in one
        fast = LLMEngine(loaded, EngineConfig(num_speculative_tokens=k, block_size=8, attention_backend="triton",
                                              max_num_seqs=8, max_model_len=128,
                                              spec_k_policy="adaptive" if policy is not None else "fixed"))
        fast.runner.short_blocks = (5,)
        fast.runner.graphs = graphs = EagerGraphs(fast.runner, 8)
        if policy is not None:
            fast.batch.policy = policy
        fast.runner.prefill_graphs = pg = PrefillGraphs(fast.runner, 256, 8)
        pg.defer = True
        monkeypatch.setattr("engine.runner.prefill_graphs.EAGER_RUNS_BEFORE_CAPTURE", 10**9)
        got = fast.generate(prompts, params)
    assert [r.output_ids for r in got] == [r.output_ids for r in want]
    for a, b in zip(got, want, strict=True):
        assert [lp.logprob for lp in a.logprobs] == pytest.approx([lp.logprob for lp in b.logprobs], abs=1e-4)
    assert fast.num_free_blocks == fast.blocks.capacity
    return graphs.keys, pg.pending, fast.runner.max_blocks


@pytest.mark.parametrize("k,middle", [(0, None), (3, CONSTRAINED)])
def test_the_graph_path_with_padding_rows_equals_reference(k, middle, monkeypatch):
    """The graphs' padded steps (`padded_run`), with chunks that fit one query tile (attention
    rotates and writes the keys itself), and decode at both block-table widths with padding rows:
    no kernel reads or writes outside its tensors (a prefill padding row's attention once read
    before the KV cache: session 12)."""
    prompts = [[7 + (i * 13 + j) % 50 for j in range(n)] for i, (n, _) in enumerate(LENGTHS)]
    params = [SamplingParams(max_tokens=m, ignore_eos=True, logprobs=2) for _, m in LENGTHS]
    if middle is not None:
        params[1] = dataclasses.replace(middle, max_tokens=LENGTHS[1][1])
    keys, prefill_keys, max_blocks = padded_run(k, prompts, params, monkeypatch)
    assert any(key.rows == 8 for key in prefill_keys), "the five prompts prefilled in the 8-row bucket"
    assert {key[-1] for n, key in keys if n < key[0]} == {5, max_blocks}, "padding rows ran at both widths"


@pytest.mark.parametrize("k", [0, 3])
def test_constrained_greedy_steps_mask_inside_the_head_gemm(k, monkeypatch):
    """A constrained all-greedy step with no logprobs or penalties (one constrained request beside
    plain ones, through the graphs' padded halves): the grammar masks apply inside the LM head's
    argmax (kernels/linear.py), the forward half computes no logits and the runner's mask_rows
    never runs; the tokens are the reference's before issue 53 (the logits masked, then argmax)."""
    import engine.runner.model_runner as runner_mod
    from kernels import linear as L

    prompts = [[7 + (i * 13 + j) % 50 for j in range(n)] for i, (n, _) in enumerate(LENGTHS)]
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for _, m in LENGTHS]
    params[1] = SamplingParams(max_tokens=LENGTHS[1][1], structured=CONSTRAINED.structured)
    with monkeypatch.context() as before:  # the runner's masks on the logits, as they were
        before.setattr(runner_mod, "head_argmax",
                       lambda flags, logprobs: flags[0] and not (logprobs or flags[2] or flags[3]))
        want = reference(k).generate(prompts, params)
    masked: list[bool] = []
    real = L.linear_argmax_triton
    monkeypatch.setattr(L, "linear_argmax_triton",
                        lambda *a, **kw: masked.append(kw.get("mask") is not None) or real(*a, **kw))
    monkeypatch.setattr(runner_mod, "mask_rows", lambda *a: pytest.fail("the logits were masked"))
    real_forward = runner_mod.ModelRunner.decode_forward
    logits: list[bool] = []

    def forward(self, *a, **kw):
        out = real_forward(self, *a, **kw)
        logits.append(out.logits is not None)
        return out

    monkeypatch.setattr(runner_mod.ModelRunner, "decode_forward", forward)
    keys, _, _ = padded_run(k, prompts, params, monkeypatch, want=want)
    assert any(key[4] for _, key in keys), "constrained steps ran"
    assert any(masked) and not any(logits)


def test_the_graph_path_switching_k_equals_fixed_k(monkeypatch):
    """Adaptive k's plain steps (no drafts read: the state's drafts as an empty view) and the K steps
    after them, through the Triton kernels with padding rows: greedy tokens and logprobs are the
    fixed-k reference's."""
    from tests.engine.test_adaptive_k import SWITCHES, Scripted

    prompts = [[7 + (i * 13 + j) % 50 for j in range(n)] for i, (n, _) in enumerate(LENGTHS)]
    params = [SamplingParams(max_tokens=m, ignore_eos=True, logprobs=2) for _, m in LENGTHS]
    policy = Scripted(SWITCHES)
    padded_run(3, prompts, params, monkeypatch, policy)
    assert any(k == 0 for k, _ in policy.seen) and any(stale for _, stale in policy.seen)


def test_the_graph_path_with_padding_rows_and_a_long_chunk_equals_reference(monkeypatch):
    """A prefill bucket whose longest chunk takes more than one query tile (70 tokens: the rotary
    kernel, then attention over the cache) with a padding row."""
    prompts = [[7 + j % 50 for j in range(70)], [5, 6, 7], list(range(20, 29))]
    keys, prefill_keys, _ = padded_run(0, prompts, SamplingParams(max_tokens=6, ignore_eos=True, logprobs=2),
                                       monkeypatch)
    assert any(key.rows == 4 and key.max_q == 128 for key in prefill_keys)
    assert any(n < key[0] for n, key in keys)
