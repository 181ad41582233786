"""`pdserve bench prefill`: time to first token inside one process, against HF and the floor.

Each case `BxN` (B prompts of N random tokens) is one `LLMEngine.step()` that prefills the
whole batch and samples its first tokens (max_tokens=1: no decode follows), timed from the
step's start until it returns them on the host; the median of `--iters` steps after warm-up
(the first step of a shape captures its prefill graph). At k = 0 and k (the MTP layer over the
prompt and the k chained drafts are part of prefill). From the same process: Hugging Face
`LlamaForCausalLM` forward (sdpa, logits_to_keep=1) on the same weights and inputs, and the
floor: 2 x non-embedding parameters x tokens + causal attention (2 x 2 x Hq x D x N^2 / 2 per
layer and prompt) FLOPs, over the bf16 matmul rate measured here.

`--profile` adds, per case: kernels per step, the GPU-busy share of the step, the GPU's
summed kernel time, host time per target layer (host time of the step / layers), the kernels
taking most GPU time, and the host functions taking most of a step (cProfile).
Prints one JSON object per case and k, then a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from bench.engine import add_model_arguments, busy_share, load, sync_device
from bench.extras import require
from engine.engine import EngineConfig, LLMEngine
from engine.model.loader import LoadedModel
from engine.runner.model_runner import kv_room_needed
from engine.sampling.sampling_params import SamplingParams

BLOCK_SIZE = 16
CONTEXT_SLACK = 8  # a case's context: its prompt and room for the first token and the drafts
DEFAULT_CASES = "1x128,1x512,1x2048,16x512,4x4096"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.add_argument("--cases", default=DEFAULT_CASES, metavar="BxN,...", help="batch x prompt tokens per case")
    p.add_argument("--spec-tokens", type=int, default=3, help="also time prefill with this many MTP drafts")
    p.add_argument("--draft-vocab", type=int, default=0, metavar="N",
                   help="MTP drafts over the N most frequent tokens (FR-Spec; 0: the full vocabulary)")
    p.add_argument("--iters", type=int, default=20, help="timed steps per case (median)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for prefill")
    p.add_argument("--deterministic", action="store_true", help="batch-invariant kernels (time their cost)")
    p.add_argument("--profile", action="store_true", help="kernels, GPU busy and host time per layer")
    p.add_argument("--hf", action="store_true", help="also time Hugging Face forward on the same weights (CUDA)")


def parse_cases(text: str) -> list[tuple[int, int]]:
    try:
        cases = [tuple(int(x) for x in part.lower().split("x")) for part in text.split(",")]
    except ValueError:
        cases = []
    if not cases or any(len(c) != 2 or min(c) < 1 for c in cases):
        raise ValueError(f"--cases takes BxN pairs separated by commas (e.g. 1x128,16x512), got {text!r}")
    return [(b, n) for b, n in cases]  # type: ignore[misc]


def _engine(loaded: LoadedModel, k: int, batch: int, n: int, args: argparse.Namespace) -> LLMEngine:
    max_len = n + CONTEXT_SLACK
    per_seq = -(-kv_room_needed(max_len, k) // BLOCK_SIZE)
    return LLMEngine(loaded, EngineConfig(
        num_speculative_tokens=k, draft_vocab_size=args.draft_vocab if k else 0, device=args.device, max_num_seqs=batch, block_size=BLOCK_SIZE,
        num_blocks=1 + batch * per_seq, max_num_batched_tokens=batch * n, max_model_len=max_len,
        enforce_eager=args.enforce_eager, deterministic=args.deterministic))


def _prompts(vocab: int, batch: int, n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for _ in range(batch)]


def _ttft_step(engine: LLMEngine, prompts: list[list[int]], whole: list[float] | None = None) -> float:
    """Seconds of the one step that prefills `prompts` and returns their first tokens, on an idle
    device (the previous step's MTP drafts, which run after its first tokens leave, are waited
    for first). `whole` gets the seconds until the step's device work is all done, drafts too."""
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    for p in prompts:
        engine.add_request(p, params)
    sync_device(engine.runner.device.type)
    start = time.perf_counter()
    outs = engine.step()
    took = time.perf_counter() - start
    if whole is not None:
        sync_device(engine.runner.device.type)
        whole.append(time.perf_counter() - start)
    assert len(outs) == len(prompts) and not engine.has_unfinished(), "the batch prefills in one step"
    engine.requests.clear()
    return took


def time_case(loaded: LoadedModel, k: int, batch: int, n: int, args: argparse.Namespace) -> dict:
    engine = _engine(loaded, k, batch, n, args)
    prompts = _prompts(loaded.model.config.vocab_size, batch, n)
    for _ in range(3):
        _ttft_step(engine, prompts)  # capture + warm-up
    whole: list[float] = []
    times = [_ttft_step(engine, prompts, whole) for _ in range(args.iters)]
    out = {"model": loaded.name, "device": args.device, "dtype": str(next(loaded.model.parameters()).dtype),
           "spec_tokens": k, "draft_vocab": (args.draft_vocab or None) if k else None, "batch": batch, "prompt": n, "graphs": engine.runner.prefill_graphs is not None,
           "deterministic": args.deterministic, "ttft_ms": round(1000 * statistics.median(times), 3),
           "ttft_min_ms": round(1000 * min(times), 3), "step_ms": round(1000 * statistics.median(whole), 3)}
    if args.profile and args.device.startswith("cuda"):
        out.update(profile_step(engine, prompts))
    return out


def profile_step(engine: LLMEngine, prompts: list[list[int]], steps: int = 5) -> dict:
    """Kernels per step, GPU-busy share of the step, GPU kernel time, host ms per target layer,
    the kernels taking most GPU time (name, launches and us per step), and the host functions
    taking most time in a step (cProfile, cumulative ms per step)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    host = []
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            host.append(_ttft_step(engine, prompts))
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    spans = sorted((e.time_range.start, e.time_range.end) for e in events)
    layers = engine.runner.num_target_layers
    return {"kernels_per_step": round(len(spans) / steps, 1), "gpu_busy": round(busy_share(spans), 4),
            "gpu_ms_per_step": round(sum(e - s for s, e in spans) / steps / 1e3, 3),
            "host_ms_per_layer": round(1000 * statistics.median(host) / layers, 4),
            "top_kernels": top_kernels(events, steps), "top_host": top_host(engine, prompts, steps),
            "phases_ms": host_phases(engine, prompts, steps)}


def host_phases(engine: LLMEngine, prompts: list[list[int]], steps: int) -> dict[str, float]:
    """Median host ms of a step's phases: before the runner (schedule), inside it (pack the
    inputs, launch the graph) and after it (wait for the first tokens, emit)."""
    runner, phases = engine.runner, []
    inner = runner.prefill
    marks: list[float] = []

    def timed_prefill(*a, **kw):  # type: ignore[no-untyped-def]
        marks.append(time.perf_counter())
        out = inner(*a, **kw)
        marks.append(time.perf_counter())
        return out

    runner.prefill = timed_prefill  # type: ignore[method-assign]
    try:
        for _ in range(steps):
            marks.clear()
            took = _ttft_step(engine, prompts)
            after = time.perf_counter() - marks[1]  # (+ the bench's own check and clear, ~us)
            phases.append((took - (marks[1] - marks[0]) - after, marks[1] - marks[0], after))
    finally:
        del runner.prefill  # back to the class's method
    return {name: round(1000 * statistics.median(p[i] for p in phases), 3)
            for i, name in enumerate(("schedule", "pack_and_launch", "wait_and_emit"))}


def top_kernels(events: list, steps: int, n: int = 12) -> list[tuple[str, float, float]]:
    """(name, launches per step, us per step) of the kernels taking most GPU time."""
    total: dict[str, list[float]] = {}
    for e in events:
        t = total.setdefault(e.name[:70], [0, 0.0])
        t[0] += 1
        t[1] += e.time_range.end - e.time_range.start
    top = sorted(total.items(), key=lambda kv: -kv[1][1])[:n]
    return [(name, round(c / steps, 1), round(us / steps, 1)) for name, (c, us) in top]


def top_host(engine: LLMEngine, prompts: list[list[int]], steps: int, n: int = 15) -> list[tuple[str, float]]:
    """(function, cumulative host ms per step) of the functions a step spends most time in."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        _ttft_step(engine, prompts)
    prof.disable()
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    rows = [(f"{fn[0].rsplit('/', 2)[-1]}:{fn[1]}:{fn[2]}", ct) for fn, (_, _, _, ct, _) in stats.items()]
    rows.sort(key=lambda r: -r[1])
    return [(name, round(1000 * ct / steps, 3)) for name, ct in rows[:n]]


def matmul_tflops(device: str) -> float:
    """Measured bf16 matmul rate (8192^3, median of 10)."""
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(10):
        torch.cuda.synchronize()
        start = time.perf_counter()
        a @ b
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return 2 * 8192**3 / statistics.median(times) / 1e12


def floor_ms(loaded: LoadedModel, batch: int, n: int, tflops: float) -> float:
    """2 x non-embedding parameters x tokens + causal attention FLOPs, at `tflops`."""
    c, model = loaded.model.config, loaded.model
    skip = {id(model.model.embed_tokens.weight), id(model.lm_head.weight)}
    skip |= {id(p) for p in model.mtp.parameters()} if model.mtp is not None else set()
    params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values() if id(p) not in skip)
    attention = c.num_hidden_layers * batch * 2 * c.num_attention_heads * c.head_dim * n * n
    return 1000 * (2 * params * batch * n + attention) / (tflops * 1e12)


def time_hf(loaded: LoadedModel, batch: int, n: int, args: argparse.Namespace) -> float:
    """Median ms of HF LlamaForCausalLM forward (sdpa, logits_to_keep=1) on the same weights."""
    transformers = require("transformers")

    c = loaded.model.config
    hf_cfg = transformers.LlamaConfig(**c.to_hf_dict())
    setattr(hf_cfg, "_attn_implementation", "sdpa")  # noqa: B010  (transformers' own switch)
    with torch.device(args.device):
        hf = transformers.LlamaForCausalLM(hf_cfg).to(next(loaded.model.parameters()).dtype)  # type: ignore[arg-type]
    hf.eval()
    hf.load_state_dict({k: v for k, v in loaded.model.state_dict().items() if not k.startswith("mtp.")}, strict=False)
    ids = torch.tensor(_prompts(c.vocab_size, batch, n), device=args.device)
    times = []
    with torch.no_grad():
        for i in range(args.iters + 3):
            torch.cuda.synchronize()
            start = time.perf_counter()
            hf(input_ids=ids, logits_to_keep=1).logits.argmax(-1).tolist()
            if i >= 3:
                times.append(time.perf_counter() - start)
    del hf
    return 1000 * statistics.median(times)


def fitting_cases(loaded: LoadedModel, cases: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The cases whose prompts fit the model's positions; each one left out is named on stderr,
    and none fitting is an error (the default cases go up to 4096 tokens, past tiny's context)."""
    limit = loaded.model.config.max_position_embeddings
    fit = [(b, n) for b, n in cases if n + CONTEXT_SLACK <= limit]
    for b, n in sorted(set(cases) - set(fit)):
        print(f"note: case {b}x{n} skipped: {loaded.name} has {limit} positions", file=sys.stderr)
    if not fit:
        raise ValueError(f"no case of --cases {','.join(f'{b}x{n}' for b, n in cases)} fits {loaded.name}'s "
                         f"{limit} positions (a prompt of N tokens needs N + {CONTEXT_SLACK})")
    return fit


def run(args: argparse.Namespace) -> int:
    cases = parse_cases(args.cases)
    loaded = load(args, args.device)
    cases = fitting_cases(loaded, cases)
    cuda = args.device.startswith("cuda")
    tflops = matmul_tflops(args.device) if cuda else None
    rows = []
    with torch.no_grad():
        for batch, n in cases:
            for k in sorted({0, args.spec_tokens}):
                out = time_case(loaded, k, batch, n, args)
                if tflops is not None:
                    out["matmul_tflops"] = round(tflops, 1)
                    out["floor_ms"] = round(floor_ms(loaded, batch, n, tflops), 4)
                if args.hf and cuda and k == 0:
                    out["hf_ms"] = round(time_hf(loaded, batch, n, args), 3)
                print(json.dumps(out), flush=True)
                rows.append(out)
    print_table(rows)
    return 0


def print_table(rows: list[dict]) -> None:
    print("| model | batch x prompt | k | pdserve TTFT ms | step with drafts ms | HF ms | floor ms | x floor |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        floor = r.get("floor_ms")
        ratio = f"{r['ttft_ms'] / floor:.2f}" if floor else "-"
        print(f"| {r['model']} | {r['batch']} x {r['prompt']} | {r['spec_tokens']} | {r['ttft_ms']} | "
              f"{r.get('step_ms', '-')} | {r.get('hf_ms', '-')} | {floor if floor else '-'} | {ratio} |")
    for r in rows:
        if "top_kernels" in r:
            print(f"-- {r['model']} {r['batch']} x {r['prompt']} k={r['spec_tokens']}: top kernels (per step: launches, us)")
            for name, count, us in r["top_kernels"]:
                print(f"   {us:9.1f} us {count:6.1f}x  {name}")
            print(f"   host phases (ms): {r['phases_ms']}")
            print("   top host functions (cumulative ms per step)")
            for name, ms in r["top_host"]:
                print(f"   {ms:9.3f} ms  {name}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m bench.prefill")
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
