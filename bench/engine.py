"""`pdserve bench engine`: single-process engine throughput and decode step time.

Runs the LLMEngine on a batch of random prompts with k = 0 and the given k, on `tiny`, the
embedded model, or random weights of a named real shape (`--model llama-3.1-8b --load-format
dummy`, or `--arch llama-1b`: engine/model/dummy.py), so GPU machines that lack the weights file can
still time real shapes. Prints one JSON object per k. On CUDA it also prints, from the same process, the floor a decode step is
compared with (parameter bytes / measured copy bandwidth) and, with `--hf`, Hugging Face
`generate` on the same weights. `--profile` adds kernels per decode step (copies, memsets and
torch's own kernels apart: `launch_counts`) and the share of the decode loop the GPU is busy
(torch profiler), and where the host's time per step goes (`bench/host_split.py`). With
PDSERVE_STEP_STAMPS=1 on CUDA (graphs on) it adds the GPU-busy share of the timed loop itself
from the GPU's clock at each decode graph's start and end, with no profiler (`gpu_busy_stamped`,
`stamped_step_us`, `stamped_gap_us`: kernels/stamps.py).
`--draft-vocab N` drafts over the N most frequent tokens (FR-Spec); random weights use the
shipped ranking of the named model (its drafts are never accepted: this times the step).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from bench.extras import require
from bench.host_split import host_split, steady_batch
from bench.step_trace import layer_increments
from engine.engine import K_POLICIES, EngineConfig, LLMEngine
from engine.grammar.structured import StructuredSpec
from engine.model.dummy import DUMMY_SHAPES
from engine.model.loader import (
    RANK_SUFFIX,
    LoadedModel,
    ModelInfo,
    load_model,
    load_model_info,
    mtp_path_default,
    ranking_path_beside,
)
from engine.runner.model_runner import kv_room_needed
from engine.sampling.sampling_params import SamplingParams
from engine.spec_decode.draft_vocab import write_ranking
from engine.tp.tensor_parallel import TPGroup
from kernels.stamps import StepStamps, stamped_busy

# `--arch NAME`: `--model NAME --load-format dummy`, under the names this bench used before the
# engine had dummy shapes too (the commands in BENCHMARKS.md use them)
ARCHES = {**{name: name for name in DUMMY_SHAPES},
          "smollm2": "smollm2-135m", "llama-1b": "llama-3.2-1b", "llama-8b": "llama-3.1-8b"}
PROFILE_STEPS = 20
BLOCK_SIZE = 16


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.add_argument("--spec-tokens", type=int, default=3)
    p.add_argument("--draft-vocab", type=int, default=0, metavar="N",
                   help="MTP drafts score the N most frequent tokens (FR-Spec); 0 = all")
    p.add_argument("--spec-k-policy", choices=K_POLICIES, default="fixed",
                   help="adaptive: each decode step runs at --spec-tokens or 0, whichever pays, from the step costs "
                        "timed at start-up (CUDA graphs) and the acceptance measured (engine/spec_decode/adaptive_k.py)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--batches", default=None, metavar="B1,B2,...",
                   help="time each of these batch sizes in turn on the one loaded model (instead of --batch)")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel ranks: N local processes (cuda:0..N-1 on CUDA); rank 0 prints")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=None,
                   help="the engine's longest sequence (default: prompt + max tokens + 8). A server's (4096 in the "
                        "engine) sizes the decode graphs' block tables and so their key splits")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for the decode step")
    p.add_argument("--deterministic", action="store_true", help="batch-invariant kernels (time their cost)")
    p.add_argument("--profile", action="store_true",
                   help=f"kernels per decode step and GPU-busy share over {PROFILE_STEPS} steps (torch profiler)")
    p.add_argument("--hf", action="store_true", help="also time Hugging Face generate on the same weights (CUDA)")
    p.add_argument("--structured-regex", default=None, metavar="REGEX",
                   help="hold every request to this regex (structured output; needs the model's tokenizer): "
                        "the grammar masks' cost per step, e.g. '[a-z ]{2000}'")
    p.add_argument("--structured-tools", type=int, default=0, metavar="N",
                   help='hold every request to tool_choice "required" over the first N functions of '
                        "bench/structured_schemas.json, parallel calls allowed (the tools grammar's cost per step)")


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny", help="tiny, smollm2, a path, a dummy shape; or use --arch")
    p.add_argument("--load-format", choices=("auto", "dummy"), default="auto",
                   help="'dummy': random weights of --model's shape (engine/model/dummy.py names llama-3.1-8b, ...)")
    p.add_argument("--arch", choices=sorted(ARCHES), default=None,
                   help="random weights of this shape (--model ARCH --load-format dummy)")


def load(args: argparse.Namespace, device: str) -> LoadedModel:
    """The model `--arch` (random weights of that shape) or `--model` names, on `device`."""
    if args.arch:
        return random_model(args.arch, device, args.dtype)
    loaded = load_model(args.model, device=device, dtype=args.dtype, load_format=args.load_format)
    return with_timing_ranking(loaded, args.model) if args.load_format == "dummy" else loaded


def random_model(arch: str, device: str, dtype: str) -> LoadedModel:
    """Seeded random weights of shape `arch` (an `ARCHES` name), drawn on `device` (an 8B shape
    would be 32 GB of fp32 on the host), the same on every GPU (every TP rank shards the same model)."""
    return with_timing_ranking(load_model(ARCHES[arch], device=device, dtype=dtype, load_format="dummy"), arch)


def with_timing_ranking(loaded: LoadedModel, name: str) -> LoadedModel:
    """A random model drafts over the shipped ranking of the model `name` names, else over ids in
    order: random weights' drafts are never accepted, so which N ids a draft vocabulary holds does
    not change a step's time."""
    ranking = loaded.vocab_rank_path or ranking_path_beside(mtp_path_default(name))
    return replace(loaded, vocab_rank_path=ranking or _timing_ranking(loaded.model.config.vocab_size))


def _timing_ranking(vocab: int) -> str:
    path = Path(tempfile.gettempdir()) / f"pdserve-timing-ranking-{vocab}{RANK_SUFFIX}"
    if not path.is_file():
        write_ranking(path, torch.arange(vocab, 0, -1), {"source": "ids in order, for timing only"})
    return str(path)


def check_context(loaded: LoadedModel, max_len: int, what: str) -> None:
    """A clear error when `max_len` tokens of context pass the model's positions (its rotary
    table ends there: the step would index past it)."""
    limit = loaded.model.config.max_position_embeddings
    if max_len > limit:
        raise ValueError(f"{what} needs a context of {max_len} tokens; {loaded.name} has {limit} positions")


def _engine(loaded: LoadedModel, k: int, args: argparse.Namespace,
            tp: TPGroup | None = None) -> tuple[LLMEngine, list[list[int]]]:
    vocab = loaded.model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.batch)]
    asked = getattr(args, "max_model_len", None)
    max_len = asked or args.prompt_len + args.max_tokens + 8
    check_context(loaded, max_len, f"--max-model-len {asked}" if asked
                  else f"--prompt-len {args.prompt_len} + --max-tokens {args.max_tokens}")
    per_seq = -(-kv_room_needed(max_len, k) // BLOCK_SIZE)
    engine = LLMEngine(loaded, EngineConfig(num_speculative_tokens=k, draft_vocab_size=args.draft_vocab if k else 0,
                                            spec_k_policy=getattr(args, "spec_k_policy", "fixed"), device=args.device,
                                            max_num_seqs=max(args.batch, 1), block_size=BLOCK_SIZE,
                                            num_blocks=1 + args.batch * per_seq,  # the whole batch at once
                                            max_num_batched_tokens=args.batch * args.prompt_len,
                                            max_model_len=max_len, enforce_eager=args.enforce_eager,
                                            deterministic=args.deterministic), tp=tp)
    if _structured(args) is not None:  # the whole run once: its graphs (captured on first use) and grammar
        engine.generate(prompts, _params(args))
    else:
        engine.generate(prompts[:1], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    return engine, prompts


def time_engine(loaded: LoadedModel, k: int, args: argparse.Namespace, tp: TPGroup | None = None) -> dict:
    engine, prompts = _engine(loaded, k, args, tp)
    params = _params(args)
    sync_device(args.device)
    for p in prompts:
        engine.add_request(p, params)
    engine.step()  # the whole batch prefills in one step
    assert not engine.waiting, "the KV cache holds the whole batch"
    stamps = _stamps(engine)
    if stamps is not None:
        stamps.reset()
    sync_device(args.device)
    k_before = list(engine.batch.k_steps)
    start, steps = time.perf_counter(), 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    sync_device(args.device)
    elapsed = time.perf_counter() - start
    done = [r for r in engine.requests.values() if r.finished][-args.batch:]
    tokens = sum(len(r.output_ids) - 1 for r in done)
    out = {"model": loaded.name, "device": args.device, "dtype": str(next(loaded.model.parameters()).dtype),
           "graphs": engine.runner.graphs is not None, "deterministic": args.deterministic, "pdl": _pdl(args.device),
           "spec_tokens": k, "tp": tp.size if tp is not None else 1, "all_reduce": _all_reduce(loaded, tp),
           "draft_vocab": (args.draft_vocab or None) if k else None, "batch": args.batch,
           "structured_regex": getattr(args, "structured_regex", None),
           "structured_tools": getattr(args, "structured_tools", 0) or None,
           "max_model_len": engine.max_model_len,
           "decode_tokens": tokens, "decode_steps": steps, "seconds": round(elapsed, 4),
           "tokens_per_s": round(tokens / elapsed, 1), "ms_per_step": round(1000 * elapsed / max(steps, 1), 3),
           **k_choice(engine, k_before)}
    if stamps is not None:
        out.update(stamped_busy(stamps.read()))
    if args.profile:
        out.update(host_split(engine, prompts, params, PROFILE_STEPS))
    if args.profile and args.device.startswith("cuda"):
        out.update(profile_decode(engine, prompts, params))
    return out


def k_choice(engine: LLMEngine, k_before: list[int]) -> dict:
    """The k policy, the share of the timed decode steps run at each k (keys "0".."k"), and with
    adaptive k the step costs it weighs (ms at k = 0 and at k, per batch bucket)."""
    ran = [n - b for n, b in zip(engine.batch.k_steps, k_before, strict=True)]
    out: dict = {"spec_k_policy": engine.config.spec_k_policy if engine.k else None,
                 "k_share": {str(k): round(n / max(sum(ran), 1), 3) for k, n in enumerate(ran) if n}}
    if engine.runner.step_costs:
        out["step_costs_ms"] = {b: [round(1000 * c, 4) for c in cs] for b, cs in engine.runner.step_costs.items()}
    return out


def _stamps(engine: LLMEngine) -> StepStamps | None:
    """The decode graphs' step stamps (PDSERVE_STEP_STAMPS=1 on CUDA, graphs on), else None."""
    graphs = engine.runner.graphs
    return graphs.stamps if graphs is not None else None


def _params(args: argparse.Namespace) -> SamplingParams:
    """Greedy, `--max-tokens` each; held to `--structured-regex` or `--structured-tools` when
    given (EOS then ends a request only where the grammar allows it)."""
    spec = _structured(args)
    if spec is None:
        return SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    return SamplingParams(max_tokens=args.max_tokens, structured=spec)


def _structured(args: argparse.Namespace) -> StructuredSpec | None:
    regex, tools = getattr(args, "structured_regex", None), getattr(args, "structured_tools", 0)
    if regex is not None and tools:
        raise ValueError("give --structured-regex or --structured-tools, not both")
    if tools:  # the router's tool grammar (pydantic), imported only when asked
        from bench.structured import tools_spec

        return tools_spec(tools)
    return StructuredSpec("regex", regex) if regex is not None else None


def _all_reduce(loaded: LoadedModel, tp: TPGroup | None) -> str | None:
    """How the TP layers all-reduce ('symm', 'nccl', 'gloo'); None without TP."""
    if tp is None or tp.size == 1:
        return None
    if loaded.model.tp.fast is not None:  # type: ignore[union-attr]
        return "symm"
    return "nccl" if next(loaded.model.parameters()).device.type == "cuda" else "gloo"


def _pdl(device: str) -> bool:
    """Whether the Triton kernels launch with programmatic dependent launch here (kernels/pdl.py)."""
    from kernels.pdl import pdl_args

    return pdl_args(torch.empty(0, device=device))["PDL"]


def profile_decode(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> dict:
    """Kernels per decode step and the GPU-busy share of the loop, over PROFILE_STEPS steps
    of the whole batch (after its prefill and a few steps)."""
    from torch.profiler import ProfilerActivity, profile

    with steady_batch(engine, prompts, params):
        torch.cuda.synchronize()
        # CUDA activity only: tracing every host op as well would slow the host enough to starve
        # the GPU (the loop is launch-ahead by one step), and the figure would measure the profiler
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(PROFILE_STEPS):
                engine.step()
            torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    spans = sorted((e.time_range.start, e.time_range.end) for e in events)
    return {**launch_counts(events), "gpu_busy": round(busy_share(spans), 4),
            "profiled_ms_per_step": round((max(e for _, e in spans) - spans[0][0]) / 1e3 / PROFILE_STEPS, 3) if spans else None,
            "gpu_us_per_step": round(sum(e - s for s, e in spans) / PROFILE_STEPS, 1),
            "all_reduce_us_per_step": round(sum(e.time_range.end - e.time_range.start for e in events
                                                if _is_collective(e.name)) / PROFILE_STEPS, 1),
            "top_kernels": top_kernels(events), "top_gaps": top_gaps(events),
            "layer_increments": layer_increments([(e.time_range.start, e.time_range.end, e.name) for e in events])}


def launch_counts(events: list) -> dict[str, float]:
    """Per decode step: `gpu_ops_per_step`, everything the GPU ran (what `kernels_per_step` counted
    before this split), split into `kernels_per_step`, `copies_per_step` (memcpy: the output copy
    to the host, the inserts' copies) and `memsets_per_step`; `torch_kernels_per_step` counts the
    kernels of torch's own ops (gathers, cats, elementwise), which the step's Triton kernels replace."""
    kinds = {"copies": 0, "memsets": 0, "kernels": 0, "torch_kernels": 0}
    for e in events:
        name = e.name.lower()
        kind = "copies" if name.startswith("memcpy") else "memsets" if name.startswith("memset") else "kernels"
        kinds[kind] += 1
        kinds["torch_kernels"] += kind == "kernels" and "at::native" in e.name
    out = {f"{kind}_per_step": round(n / PROFILE_STEPS, 1) for kind, n in kinds.items()}
    return {"gpu_ops_per_step": round(len(events) / PROFILE_STEPS, 1), **out}


def _is_collective(name: str) -> bool:
    """A TP collective's kernel: NCCL's, or symmetric memory's one-shot all-reduce."""
    low = name.lower()
    return "nccl" in low or "all_reduce" in low


def top_kernels(events: list, n: int = 25) -> list[tuple[str, float, float]]:
    """(name, us per step, launches per step) of the kernels that take the most time."""
    total: dict[str, list[float]] = {}
    for e in events:
        t = total.setdefault(e.name[:70], [0.0, 0.0])
        t[0] += e.time_range.end - e.time_range.start
        t[1] += 1
    ranked = sorted(total.items(), key=lambda kv: -kv[1][0])[:n]
    return [(name, round(us / PROFILE_STEPS, 1), round(c / PROFILE_STEPS, 1)) for name, (us, c) in ranked]


def top_gaps(events: list, n: int = 10) -> list[tuple[str, str, float, float]]:
    """Where the GPU idles: (kernel before, kernel after, idle us per step, gaps per step) for
    the idle intervals between kernels (none running), summed by the pair around them."""
    ranked = sorted(events, key=lambda e: e.time_range.start)
    total: dict[tuple[str, str], list[float]] = {}
    last, end = None, float("-inf")
    for e in ranked:
        if last is not None and e.time_range.start > end:
            t = total.setdefault((last.name[:40], e.name[:40]), [0.0, 0.0])
            t[0] += e.time_range.start - end
            t[1] += 1
        if e.time_range.end >= end:
            last, end = e, e.time_range.end
    top = sorted(total.items(), key=lambda kv: -kv[1][0])[:n]
    return [(a, b, round(us / PROFILE_STEPS, 2), round(c / PROFILE_STEPS, 1)) for (a, b), (us, c) in top]


def busy_share(spans: list[tuple[float, float]]) -> float:
    """Union of the (start, end) intervals over the span from the first start to the last end."""
    if not spans:
        return 0.0
    busy, cur_start, cur_end = 0.0, spans[0][0], spans[0][1]
    for start, end in spans[1:]:
        if start > cur_end:
            busy += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    busy += cur_end - cur_start
    return busy / max(cur_end - spans[0][0], 1e-9)


def copy_floor(loaded: LoadedModel) -> dict:
    """Device copy bandwidth (bytes read + written per second) and the weight-read floor."""
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    start, reps = time.perf_counter(), 20
    for _ in range(reps):
        dst.copy_(src)
    torch.cuda.synchronize()
    bw = 2 * n * reps / (time.perf_counter() - start)
    params = {id(p): p for p in loaded.model.parameters()}  # tied weights once
    mtp = {id(p) for p in loaded.model.mtp.parameters()} if loaded.model.mtp is not None else set()
    weight_bytes = sum(p.numel() * p.element_size() for i, p in params.items() if i not in mtp)
    return {"copy_tb_per_s": round(bw / 1e12, 3), "weight_bytes": weight_bytes,
            "floor_ms_per_step": round(1000 * weight_bytes / bw, 4)}


def time_hf(loaded: LoadedModel, args: argparse.Namespace) -> dict:
    """Hugging Face `generate` (greedy, eager) on the same weights: ms per decode step from
    the difference between max_tokens and 1 new token."""
    transformers = require("transformers")

    c = loaded.model.config
    hf_cfg = transformers.LlamaConfig(**c.to_hf_dict())
    with torch.device(args.device):
        hf = transformers.LlamaForCausalLM(hf_cfg).to(next(loaded.model.parameters()).dtype)  # type: ignore[arg-type]
    hf.eval()
    hf.load_state_dict({k: v for k, v in loaded.model.state_dict().items() if not k.startswith("mtp.")}, strict=False)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, c.vocab_size, (args.batch, args.prompt_len), generator=g).to(args.device)

    def run(n: int) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    run(4)
    one, full = run(1), run(args.max_tokens)
    step = (full - one) / (args.max_tokens - 1)
    return {"hf_generate_ms_per_step": round(1000 * step, 3), "batch": args.batch,
            "hf_tokens_per_s": round(args.batch / step, 1)}


def sync_device(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run(args: argparse.Namespace) -> int:
    if args.tp == 1:
        return bench_rank(None, args)
    if args.hf:
        raise ValueError("--hf times one GPU: use it with --tp 1")
    from engine.tp.launch import spawn_ranks
    from engine.tp.tensor_parallel import check_tp_size

    if args.arch or args.load_format == "dummy":  # a named model's ranks each raise the same clear error
        check_tp_size(model_info(args).config, args.tp)
    return max(spawn_ranks(args.tp, bench_rank, (args,), device=args.device))


def model_info(args: argparse.Namespace) -> ModelInfo:
    """What a router needs of the model `--arch` or `--model` names (no weights)."""
    if args.arch:
        return load_model_info(ARCHES[args.arch], "dummy")
    return load_model_info(args.model, args.load_format)


def bench_rank(tp: TPGroup | None, args: argparse.Namespace) -> int:
    """The bench alone (tp None) or on one rank of a local TP group; rank 0 prints."""
    from engine.tp.launch import rank_device

    args = argparse.Namespace(**{**vars(args), "device": rank_device(args.device, tp.rank if tp else 0)})
    show = tp is None or tp.rank == 0
    loaded = load(args, args.device)
    with torch.no_grad():
        for batch in _batches(args):
            for k in sorted({0, args.spec_tokens}):
                out = time_engine(loaded, k, argparse.Namespace(**{**vars(args), "batch": batch}), tp)
                if show:
                    print(json.dumps(out), flush=True)
        if args.device.startswith("cuda") and show:
            print(json.dumps(copy_floor(loaded)), flush=True)
            if args.hf:
                print(json.dumps(time_hf(loaded, args)), flush=True)
    return 0


def _batches(args: argparse.Namespace) -> list[int]:
    if not args.batches:
        return [args.batch]
    try:
        return [int(b) for b in args.batches.split(",")]
    except ValueError:
        raise ValueError(f"--batches takes batch sizes separated by commas, got {args.batches!r}") from None


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m bench.engine")
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
