"""`pdserve bench engine` on the CPU: a TP run prints rank 0's rows only, one per batch size
and k; device-drawn random weights are scaled as the host-drawn ones; the profile's launch
counts tell kernels, copies, memsets and torch's own kernels apart; the host split adds up."""

from __future__ import annotations

import argparse
import json

import pytest

from bench.engine import PROFILE_STEPS, add_arguments, k_choice, launch_counts, run
from engine.engine import EngineConfig, LLMEngine
from engine.model.dummy import fill_random_
from engine.model.loader import build_model, load_model
from engine.model.tiny import random_tensors, tiny_config
from engine.sampling.sampling_params import SamplingParams
from engine.spec_decode.adaptive_k import KPolicy


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


def test_a_tp_bench_prints_rank_zeros_rows_for_each_batch(capfd):
    assert run(_args("--model", "tiny", "--tp", "2", "--batches", "1,3", "--spec-tokens", "2",
                     "--max-tokens", "4", "--prompt-len", "8")) == 0
    rows = [json.loads(line) for line in capfd.readouterr().out.splitlines() if line.startswith("{")]
    assert [(r["batch"], r["spec_tokens"]) for r in rows] == [(1, 0), (1, 2), (3, 0), (3, 2)]  # not twice
    assert {(r["tp"], r["all_reduce"]) for r in rows} == {(2, "gloo")}
    assert all(r["decode_tokens"] == 3 * r["batch"] for r in rows)


def test_bad_batches_and_sizes_are_clear_errors():
    with pytest.raises(ValueError, match="--batches takes batch sizes separated by commas, got '1;2'"):
        run(_args("--model", "tiny", "--batches", "1;2"))
    with pytest.raises(ValueError, match="cannot split 9 query / 3 KV heads over 4 ranks"):
        run(_args("--arch", "smollm2", "--tp", "4"))  # refused before any rank starts


def test_weights_drawn_in_place_are_scaled_like_the_host_drawn_ones():
    model = build_model(tiny_config())
    fill_random_(model, 0)
    drawn = dict(model.named_parameters())
    for name, ref in random_tensors(model, 0).items():
        got = drawn[name].detach()
        assert got.mean().item() == pytest.approx(ref.mean().item(), abs=0.1 * ref.std().item() + 0.02), name
        assert got.std().item() == pytest.approx(ref.std().item(), rel=0.3, abs=0.02), name


def test_launch_counts_tell_kernels_copies_and_torch_ops_apart():
    names = ["_tail_kernel", "void at::native::index_elementwise_kernel<128, 4>", "Memcpy DtoH (Device -> Pinned)",
             "Memset (Device)", "sm90_xmma_gemm_bf16"]
    counts = launch_counts([argparse.Namespace(name=n) for n in names * PROFILE_STEPS])
    assert counts == {"gpu_ops_per_step": 5.0, "copies_per_step": 1.0, "memsets_per_step": 1.0,
                      "kernels_per_step": 3.0, "torch_kernels_per_step": 1.0}


def test_the_host_split_adds_up_and_leaves_the_engine_as_it_was(capfd):
    from engine.runner.step_output import HostCopy

    wait = HostCopy.wait
    assert run(_args("--model", "tiny", "--batch", "2", "--spec-tokens", "1", "--max-tokens", "60",
                     "--prompt-len", "8", "--profile")) == 0
    rows = [json.loads(line) for line in capfd.readouterr().out.splitlines() if line.startswith("{")]
    assert [r["spec_tokens"] for r in rows] == [0, 1]
    for r in rows:
        split = r["host_split"]
        parts = split["wait_us"] + split["launch_us"] + split["read_us"] + split["other_us"]
        assert split["launch_us"] > 0 and split["read_us"] >= 0 and split["other_us"] > 0
        assert parts == pytest.approx(split["step_us"], abs=0.5)  # each part rounded to 0.1 us
    assert HostCopy.wait is wait  # the read point is unwrapped after the run


def test_layer_increments_add_up_and_place_each_kernel_in_its_layer():
    """Three steps of a two-layer chain under PDL (each kernel starts before the one ahead of it
    ends): only the middle step counts; its increments are each kernel's end past the latest end
    before it, they add up to the step's span, and the kernels group by their offset from the last
    attention kernel (a layer's o projection at 1 in both layers)."""
    from bench.step_trace import layer_increments

    def step(t0: float) -> list[tuple[float, float, str]]:
        names = ["_step_inputs_kernel", "_skinny_kernel", "_paged_attention_kernel", "_skinny_kernel",
                 "_skinny_kernel", "_paged_attention_kernel", "_skinny_kernel", "_tail_kernel"]
        times = [(0, 2), (1, 7), (6, 9), (8, 14), (12, 19), (15, 21), (16, 26), (25, 27)]
        return [(t0 + a, t0 + b, n) for (a, b), n in zip(times, names, strict=True)]

    got = layer_increments(step(0.0) + step(40.0) + step(80.0))
    assert got["steps"] == 1 and got["step_us"] == 27.0 and got["boundary_idle_us"] is None
    rows = {(off, name): (n, inc, lead) for off, name, n, inc, lead in got["groups"]}
    assert rows[(1, "_skinny_kernel")] == (2.0, 10.0, 3.0)  # the two o projections: 5 us each past the attention
    assert rows[(0, "_paged_attention_kernel")] == (2.0, 4.0, 2.5)
    assert rows[(-2, "_step_inputs_kernel")] == (1.0, 2.0, 0.0)
    assert rows[(-1, "_skinny_kernel")] == (1.0, 5.0, 1.0)  # the first q/k/v began 1 us before the marker ended
    assert rows[(2, "_tail_kernel")] == (1.0, 1.0, 1.0)
    assert sum(inc for _, _, _, inc, _ in got["groups"]) == got["step_us"]
    idle = layer_increments(step(0.0) + step(40.0) + step(80.0) + step(120.0))
    assert idle["steps"] == 2 and idle["boundary_idle_us"] == 13.0  # 40 - 27


def test_a_context_past_the_models_positions_is_a_clear_error(capsys):
    from deploy.cli import main

    assert main(["bench", "engine", "--model", "tiny", "--prompt-len", "1000", "--max-tokens", "64"]) == 2
    assert "--max-tokens 64 needs a context of 1072 tokens; tiny has 1024 positions" in capsys.readouterr().err
    assert main(["bench", "engine", "--model", "tiny", "--max-model-len", "4096"]) == 2
    assert "--max-model-len 4096 needs a context of 4096 tokens; tiny has 1024 positions" in capsys.readouterr().err


def test_a_dummy_model_is_timed_and_drafts_over_a_timing_ranking(capfd):
    assert run(_args("--model", "tiny", "--load-format", "dummy", "--batch", "2", "--spec-tokens", "2",
                     "--draft-vocab", "16", "--max-tokens", "4", "--prompt-len", "8")) == 0
    rows = [json.loads(line) for line in capfd.readouterr().out.splitlines() if line.startswith("{")]
    assert [(r["model"], r["spec_tokens"], r["draft_vocab"], r["decode_tokens"]) for r in rows] == [
        ("tiny", 0, None, 6), ("tiny", 2, 16, 6)]


def test_the_share_of_steps_at_each_k_counts_the_timed_steps_only():
    tiny = load_model("tiny")
    engine = LLMEngine(tiny, EngineConfig(num_speculative_tokens=3, spec_k_policy="adaptive"))
    engine.batch.policy = KPolicy(3, {2: (1.0, 3.0)}, probe_every=4, probe_steps=2)  # drafts pay above 3 tokens
    engine.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True))
    before = list(engine.batch.k_steps)
    engine.generate([[4, 5], [6, 7, 8]], SamplingParams(max_tokens=30, ignore_eos=True))
    out = k_choice(engine, before)
    ran = [n - b for n, b in zip(engine.batch.k_steps, before, strict=True)]
    assert out["spec_k_policy"] == "adaptive" and set(out["k_share"]) == {"0", "3"}
    assert out["k_share"]["0"] == pytest.approx(ran[0] / sum(ran), abs=1e-3) and out["k_share"]["0"] > 0.5


def test_requests_held_to_the_tools_grammar_are_timed_under_it(capfd):
    """`--structured-tools N` holds every request to tool_choice "required" over the first N
    functions of the 50 schemas; the rows say so; a bad N or two grammars are clear errors."""
    from bench.structured import tools_spec

    assert tools_spec(3).kind == "json_schema" and '"minItems":1' in tools_spec(3).value
    assert run(_args("--model", "tiny", "--batch", "2", "--spec-tokens", "2", "--max-tokens", "6",
                     "--prompt-len", "8", "--structured-tools", "3")) == 0
    rows = [json.loads(line) for line in capfd.readouterr().out.splitlines() if line.startswith("{")]
    assert [(r["spec_tokens"], r["structured_tools"]) for r in rows] == [(0, 3), (2, 3)]
    with pytest.raises(ValueError, match="--structured-tools takes 1 to 50 functions, not 51"):
        tools_spec(51)
    with pytest.raises(ValueError, match="not both"):
        run(_args("--model", "tiny", "--structured-tools", "2", "--structured-regex", "[a-z]+"))
