"""The `pdserve` command line: `generate` (single-process engine), `up`/`status` (the service),
`bench ...`, `train-mtp`, `draft-vocab`, `certs`.

Every user error (unknown model, prompt beyond the context, k < 0, logprobs > 20,
temperature < 0, ...) prints one clear `error:` line on stderr and exits with status 2.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from typing import Any

STARTED = time.perf_counter()  # the CLI's start (before it, only the interpreter's own start-up)

from deploy.plugins import bench_kinds, bench_module  # noqa: E402


def _add_generate(sub: Any) -> None:
    from deploy.cli_service import add_load_format

    p = sub.add_parser("generate", help="generate text locally with the single-process engine")
    p.add_argument("prompts", nargs="+", metavar="PROMPT")
    p.add_argument("--model", default=None,
                   help="a HF safetensors dir, a .gguf file, 'smollm2' or 'tiny' (default: smollm2 if installed, else tiny)")
    add_load_format(p)
    p.add_argument("--spec-tokens", type=int, default=0, help="MTP draft tokens per step (k); 0 = off")
    p.add_argument("--draft-vocab", type=int, default=None, metavar="N",
                   help="MTP drafts score the model's N most frequent tokens (FR-Spec); 0 = all; "
                        "default 32768 where the vocabulary is larger and the model ships a ranking")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--logprobs", type=int, default=None, help="top-N logprobs per token (0..20)")
    p.add_argument("--json", action="store_true", help="one JSON object per prompt, one per line")
    p.add_argument("--raw", action="store_true", help="send prompts as they are (no chat template)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for the decode step")
    p.add_argument("--deterministic", action="store_true", help="batch-invariant kernels: a greedy answer does not depend on the batch or on MTP (slower)")
    p.add_argument("--enable-prefix-caching", action="store_true",
                   help="reuse the KV of prompt prefixes already computed (as vLLM's flag)")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor parallel: N local ranks (gloo on cpu, NCCL on cuda:0..N-1); rank 0 prints")
    p.add_argument("--router", default=None, metavar="HOST:PORT", help="generate through a running service")
    p.add_argument("--api-key", default=None, help="with --router: the service's key (default: $PDSERVE_API_KEY)")
    p.add_argument("--tls-ca", default=None, metavar="PEM",
                   help="with --router: speak TLS, trusting this CA file ('system': the system's roots)")
    p.set_defaults(func=cmd_generate)


def _add_bench(sub: Any) -> None:
    p = sub.add_parser("bench", help="benchmarks (pdserve bench KIND --help)")
    kinds = p.add_subparsers(dest="bench", required=True)
    for name, _, text in bench_kinds():
        kinds.add_parser(name, help=text)  # listed for --help; `main` dispatches these itself


def _run_module(module_name: str, prog: str, argv: list[str]) -> int:
    module = importlib.import_module(module_name)
    parser = argparse.ArgumentParser(prog=prog, description=(module.__doc__ or "").splitlines()[0])
    module.add_arguments(parser)
    return int(module.run(parser.parse_args(argv)))


def _add_train_mtp(sub: Any) -> None:
    sub.add_parser("train-mtp", help="train an MTP head for a model by self-distillation "
                   "(pdserve train-mtp --help)")  # listed for --help; `main` dispatches it
    sub.add_parser("draft-vocab", help="rank a model's vocabulary by how often it writes each token, "
                   "for --draft-vocab (pdserve draft-vocab --help)")  # as train-mtp
    sub.add_parser("certs", help="write a development CA and a certificate for node mutual TLS and the "
                   "router's TLS (pdserve certs --help)")  # as train-mtp


def _add_service(sub: Any) -> None:
    from deploy import cli_service

    up = sub.add_parser("up", help="start the service (router + prefill + decode nodes, or colocated ones, on Ray)")
    cli_service.add_service_arguments(up)
    up.add_argument("--port", type=int, default=None, help="router gRPC port (default 50051)")
    up.add_argument("--http-port", type=int, default=None,
                    help="router HTTP port: OpenAI-compatible /v1, /metrics, /health (default 8000)")
    up.add_argument("--address", default=None,
                    help="join this Ray cluster ('auto': the one this machine is part of; default: start a local one)")
    up.set_defaults(func=cli_service.cmd_up)
    _add_status(sub)
    demo = sub.add_parser("demo", help="start the service locally, send a few real prompts, print timings")
    cli_service.add_service_arguments(demo)
    demo.add_argument("--max-tokens", type=int, default=48)
    demo.add_argument("--tls-ca", default=None, metavar="PEM", help="with --tls-cert: the CA the demo's client "
                      "trusts (default: the certificate itself, as when it is self-signed)")
    demo.set_defaults(func=cli_service.cmd_demo, spec_tokens=3)


def _cmd_status(args: argparse.Namespace) -> int:
    from deploy.status import cmd_status  # here, not at parse time: generate needs no service deps

    return cmd_status(args)


def _add_status(sub: Any) -> None:
    p = sub.add_parser("status", help="a running service's nodes, placement, health, queue and free KV blocks")
    p.add_argument("--address", default="auto", help="the service's Ray cluster (default: auto)")
    p.add_argument("--namespace", default="pdserve", help="the service's Ray namespace (cluster.namespace)")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for each actor's answer")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_status)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_service(sub)
    _add_bench(sub)
    _add_train_mtp(sub)
    return parser


def encode_prompt(tokenizer: Any, text: str, raw: bool) -> list[int]:
    if not raw and getattr(tokenizer, "has_chat_template", False):
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        return tokenizer.encode(rendered, add_special_tokens=False)
    return tokenizer.encode(text, add_special_tokens=True)


def result_json(tokenizer: Any, req: Any) -> dict:
    return {
        "text": tokenizer.decode(req.output_ids, skip_special_tokens=True),
        "prompt_token_ids": req.prompt,
        "token_ids": req.output_ids,
        "logprobs": [lp.to_json() for lp in req.logprobs] if req.params.logprobs is not None else None,
        "finish_reason": req.finish_reason,
        "stats": {
            "steps": req.steps,
            "accepted_tokens": req.accepted_tokens,
            "mean_accepted_per_step": round(req.mean_accepted_per_step, 4),
        },
    }


def cmd_generate(args: argparse.Namespace) -> int:
    if args.router:
        from deploy.cli_service import generate_via_router

        return generate_via_router(args)
    if args.tp < 1 or args.tp & (args.tp - 1):
        raise ValueError(f"--tp must be a power of two (1, 2, 4, ...), got {args.tp}")
    if args.tp == 1:
        return generate_rank(None, args)
    from engine.tp.launch import check_tp_model, spawn_ranks

    check_tp_model(args.model, args.tp, "--tp", args.load_format or "auto")

    return max(spawn_ranks(args.tp, generate_rank, (args,), device=args.device))


def generate_rank(tp: Any, args: argparse.Namespace) -> int:
    """`pdserve generate` alone (tp None) or on one rank of a local TP group: every rank runs the
    same engine on the same prompts; rank 0 alone prints. Its start-up phases go to stderr."""
    t_imports = time.perf_counter()
    start_cuda_init(args.device, tp.rank if tp is not None else 0)
    from engine.engine import EngineConfig, LLMEngine
    from engine.model.loader import load_model
    from engine.model.paths import default_model
    from engine.sampling.sampling_params import SamplingParams
    from engine.tp.launch import rank_device

    params = SamplingParams(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
        max_tokens=args.max_tokens, logprobs=args.logprobs,
    )
    device = rank_device(args.device, tp.rank if tp is not None else 0)
    config = EngineConfig(num_speculative_tokens=args.spec_tokens, draft_vocab_size=args.draft_vocab,
                          device=device, max_model_len=args.max_model_len, enforce_eager=args.enforce_eager,
                          deterministic=args.deterministic, enable_prefix_caching=args.enable_prefix_caching,
                          max_num_seqs=batch_for(len(args.prompts), EngineConfig.max_num_seqs))
    t0 = time.perf_counter()
    loaded = load_model(args.model or default_model(), device=device, dtype=args.dtype,
                        load_format=args.load_format or "auto")
    t1 = time.perf_counter()
    engine = LLMEngine(loaded, config, tp=tp)
    t2 = time.perf_counter()
    prompts = [encode_prompt(loaded.tokenizer, p, args.raw) for p in args.prompts]
    start = time.perf_counter()
    results = engine.generate(prompts, params)
    if tp is None or tp.rank == 0:  # start-up phases (graphs are captured on first use, in generate)
        end = time.perf_counter()
        print(f"imports {t0 - t_imports:.2f} s, load {t1 - t0:.2f} s, engine {t2 - t1:.2f} s, generate "
              f"{end - start:.2f} s; {end - STARTED:.2f} s since the CLI started", file=sys.stderr)
    if tp is None or tp.rank == 0:
        print_results(loaded.tokenizer, results, args.json, time.perf_counter() - start)
    return 0


def start_cuda_init(device: str, rank: int) -> None:
    """On CUDA, create rank `rank`'s context (cuda:rank, as engine.tp.launch.rank_device) in a
    background thread, overlapping the engine's imports and the GGUF read (engine/cuda_init.py)."""
    from engine.cuda_init import start_cuda_init as start

    if device.startswith("cuda"):
        start(f"cuda:{rank}")


def batch_for(num_prompts: int, most: int) -> int:
    """The engine's batch for `num_prompts`: the decode graph bucket they run in (a power of two,
    at most `most`), so `generate` captures only the buckets it can use and every step runs in
    the bucket it would run in with the full batch (the same shapes, the same bits)."""
    return min(most, 1 << max(num_prompts - 1, 0).bit_length())


def print_results(tokenizer: Any, results: list[Any], as_json: bool, elapsed: float) -> None:
    for req in results:
        out = result_json(tokenizer, req)
        if as_json:
            print(json.dumps(out))
        else:
            s = out["stats"]
            print(f"{out['text']}\n  [{len(req.output_ids)} tokens, {req.finish_reason}, "
                  f"{s['mean_accepted_per_step']:.2f} tokens/step]")
    sys.stdout.flush()  # a rank's output leaves before its process ends
    if not as_json:
        total = sum(len(r.output_ids) for r in results)
        print(f"{total} tokens in {elapsed:.2f} s ({total / elapsed:.1f} tok/s)", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        if len(argv) >= 2 and argv[0] == "bench" and (module := bench_module(argv[1])) is not None:
            return _run_module(module, f"pdserve bench {argv[1]}", argv[2:])
        if argv and argv[0] == "train-mtp":
            return _run_module("mtp.train", "pdserve train-mtp", argv[1:])
        if argv and argv[0] == "draft-vocab":
            return _run_module("mtp.vocab_rank", "pdserve draft-vocab", argv[1:])
        if argv and argv[0] == "certs":
            return _run_module("deploy.certs", "pdserve certs", argv[1:])
        args = build_parser().parse_args(argv)
        return int(args.func(args))
    except (ValueError, FileNotFoundError, ModuleNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
