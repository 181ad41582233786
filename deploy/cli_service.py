"""`pdserve up`, `pdserve demo` and `pdserve generate --router`: the service (disaggregated, or
colocated with `--colocated N`)."""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import tempfile
import threading
import time
from typing import Any

import settings

DEMO_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one sentence what a GPU is.",
    "List three primary colors.",
]


def service_config(args: argparse.Namespace, local: bool = False) -> Any:
    from deploy.config import ServiceConfig, parse_overrides

    overrides = parse_overrides(getattr(args, "set", None) or [])
    for flag, key in (("model", "model.name"), ("load_format", "model.load_format"),
                      ("max_model_len", "model.max_model_len"),
                      ("prefill", "prefill.num_nodes"), ("decode", "decode.num_nodes"),
                      ("spec_tokens", "spec.num_speculative_tokens"), ("draft_vocab", "spec.draft_vocab_size"),
                      ("spec_k_policy", "spec.k_policy"),
                      ("port", "router.port"), ("http_port", "router.http_port"),
                      ("address", "cluster.address"), ("device", "model.device"),
                      ("enforce_eager", "model.enforce_eager"), ("deterministic", "model.deterministic"),
                      ("tls_cert", "router.tls_cert"), ("tls_key", "router.tls_key"),
                      ("node_tls_ca", "cluster.node_tls_ca"), ("node_tls_cert", "cluster.node_tls_cert"),
                      ("node_tls_key", "cluster.node_tls_key"),
                      ("enable_prefix_caching", "prefill.prefix_cache"),
                      ("enable_prefix_caching", "colocated.prefix_cache"), ("colocated", "colocated.num_nodes"),
                      ("max_num_batched_tokens", "prefill.max_num_batched_tokens"),
                      ("max_num_batched_tokens", "colocated.max_num_batched_tokens"),
                      ("max_num_seqs", "decode.max_num_seqs"), ("max_num_seqs", "colocated.max_num_seqs"),
                      ("prefill_tp", "prefill.tp"), ("decode_tp", "decode.tp"),
                      ("router_processes", "router.processes"), ("tool_call_parser", "router.tool_call_parser"),
                      ("enable_auto_tool_choice", "router.enable_auto_tool_choice")):
        value = getattr(args, flag, None)
        if value is not None:
            overrides[key] = value
    api_key = getattr(args, "api_key", None) or settings.API_KEY
    if api_key and hasattr(args, "api_key"):  # the service's own key
        overrides["router.api_key"] = api_key
    if local:
        overrides.setdefault("router.host", "127.0.0.1")
        overrides.setdefault("router.port", 0)
        overrides.setdefault("router.http_port", 0)
    return ServiceConfig.load(getattr(args, "config", None), overrides)


def add_service_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help="YAML service config (unknown keys are errors)")
    p.add_argument("--model", default=None)
    add_load_format(p)
    p.add_argument("--max-model-len", type=int, default=None, metavar="N",
                   help="the longest prompt + output served (default: the model's positions, at most 4096)")
    p.add_argument("--prefill", type=int, default=None, help="prefill nodes")
    p.add_argument("--decode", type=int, default=None, help="decode nodes")
    p.add_argument("--colocated", type=int, default=None, metavar="N",
                   help="a colocated service: N nodes that each prefill and decode their own requests (no KV "
                   "transfer; no prefill or decode nodes)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, metavar="N",
                   help="prompt tokens per prefill step: a prefill node's batch, a colocated node's chunk between "
                   "two decode steps (defaults: 2048 and 512)")
    p.add_argument("--max-num-seqs", type=int, default=None, metavar="N",
                   help="requests decoding at once per decode or colocated node (default 32)")
    p.add_argument("--prefill-tp", type=int, default=None, help="tensor-parallel ranks per prefill node")
    p.add_argument("--decode-tp", type=int, default=None, help="tensor-parallel ranks per decode node (= --prefill-tp)")
    p.add_argument("--router-processes", type=int, default=None, metavar="N",
                   help="router processes sharing its ports (vLLM's --api-server-count; default 1)")
    p.add_argument("--spec-tokens", type=int, default=None, help="MTP draft tokens per step (k)")
    p.add_argument("--draft-vocab", type=int, default=None, metavar="N",
                   help="MTP drafts score the model's N most frequent tokens (FR-Spec); 0 = all; "
                        "default 32768 where the vocabulary is larger and the model ships a ranking")
    p.add_argument("--spec-k-policy", choices=("fixed", "adaptive"), default=None,
                   help="fixed: every decode step verifies k drafts; adaptive: k or 0 per step, whichever pays "
                        "(docs/configuration.md)")
    p.add_argument("--device", default=None, help="cpu, cuda or auto")
    p.add_argument("--api-key", default=None,
                   help="clients must send 'authorization: Bearer KEY' (default: $PDSERVE_API_KEY; none: no auth)")
    p.add_argument("--tls-cert", "--ssl-certfile", dest="tls_cert", default=None, metavar="PEM",
                   help="serve the router's gRPC and HTTP ports over TLS with this certificate chain")
    p.add_argument("--tls-key", "--ssl-keyfile", dest="tls_key", default=None, metavar="PEM",
                   help="the private key of --tls-cert")
    p.add_argument("--node-tls-ca", default=None, metavar="PEM",
                   help="mutual TLS between router and nodes: the cluster CA (with --node-tls-cert/-key)")
    p.add_argument("--node-tls-cert", default=None, metavar="PEM",
                   help="the node certificate chain every node serves and the router and prefill nodes present; "
                   "it must name pdserve-node (pdserve certs makes one)")
    p.add_argument("--node-tls-key", default=None, metavar="PEM", help="the private key of --node-tls-cert")
    p.add_argument("--deterministic", action="store_true", default=None, help="batch-invariant kernels: a greedy answer does not depend on the batch or on MTP (slower)")
    p.add_argument("--enforce-eager", action="store_true", default=None,
                   help="run the decode step eagerly, without CUDA graphs")
    p.add_argument("--enable-prefix-caching", action="store_true", default=None,
                   help="prefill nodes reuse the KV of prompt prefixes they computed (prefill.prefix_cache); "
                   "pair with --set router.policy=prefix")
    p.add_argument("--tool-call-parser", choices=("hermes", "llama3_json"), default=None,
                   help="the syntax the model writes tool calls in, read back for tool_choice 'auto' (as vLLM's)")
    p.add_argument("--enable-auto-tool-choice", action="store_true", default=None,
                   help="let the model decide whether to call a tool (tool_choice 'auto'; needs --tool-call-parser)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="any config key, e.g. decode.max_num_seqs=64")


def add_load_format(p: argparse.ArgumentParser) -> None:
    p.add_argument("--load-format", choices=("auto", "dummy"), default=None,
                   help="'dummy': random weights of --model's shape, a named one (llama-3.2-1b, llama-3.1-8b, "
                   "qwen2.5-7b, smollm2-135m) or a model's, for timing real sizes without weights (as vLLM's)")


def start_service(cfg: Any) -> tuple[Any, str]:
    from deploy.actors import node_tls
    from deploy.procmem import gc_paused
    from deploy.service import Service, init_ray

    started = time.perf_counter()
    node_tls(cfg)  # unusable node TLS files: one clear error before Ray starts
    check_tp_fits(cfg)
    probe = probe_device(cfg)
    t0 = time.perf_counter()
    with gc_paused():  # no full collections through Ray's imports and start, on the way to ready
        init_ray(cfg, temp_dir=tempfile.mkdtemp(prefix="pdserve-ray-") if cfg.cluster.address is None else None)
    ray_s = time.perf_counter() - t0
    if probe is not None:
        probe.join()
    service = Service(cfg)
    address = service.start(timeout_s=cfg.cluster.start_timeout_s)
    service.startup["ray_init"] = round(ray_s, 2)
    service.startup["total"] = round(time.perf_counter() - started, 2)
    return service, address


def probe_device(cfg: Any) -> threading.Thread | None:
    """With `model.device: auto`, the service asks torch which device the nodes get (deploy/service.py:
    whether they take GPUs): torch's import and CUDA probe then run in a thread while Ray starts,
    rather than after it, where they would hold back every actor's creation."""
    if cfg.model.device != "auto":
        return None

    def probe() -> None:
        try:
            cfg.model.resolved_device()
        except Exception:
            pass  # the service's own call meets the error with its message

    thread = threading.Thread(target=probe, name="device-probe", daemon=True)
    thread.start()
    return thread


def startup_line(service: Any) -> str:
    """Where `pdserve up`'s start went: in all (from the start of `start_service`), Ray, the router,
    and the slowest node's phases (its worker process, imports, model load, node build with CUDA
    graph capture, serve)."""
    s = service.startup
    total = s.get("total", s.get("ray_init", 0.0) + s.get("nodes_serving", 0.0))
    line = (f"ready in {total:.1f} s: Ray {s.get('ray_init', 0.0):.1f} s, router serving at "
            f"{s.get('router_serving', 0.0):.1f} s, nodes at {s.get('nodes_serving', 0.0):.1f} s")
    try:
        nodes = {f"{role}-{i}": info.get("startup", {}) for (role, i), info in service.node_info().items()}
    except Exception:  # a node restarting: the line without it
        return line
    if nodes:
        name, phases = max(nodes.items(), key=lambda kv: sum(kv[1].values()))
        line += f"; slowest node {name}: " + ", ".join(f"{k} {v:.1f} s" for k, v in phases.items())
    return line


def check_tp_fits(cfg: Any) -> None:
    """On a local cluster (the model is on this host), a TP size the model does not split over
    is an error before any actor starts, not rank groups failing and restarting until the start
    times out. (prefill.tp equals decode.tp: the config checks it.)"""
    if cfg.decode.tp > 1 and cfg.cluster.address is None:
        from engine.tp.launch import check_tp_model

        check_tp_model(cfg.model.resolved_name(), cfg.decode.tp, "decode.tp", cfg.model.load_format)


def shutdown(service: Any) -> None:
    import ray

    service.stop()
    ray.shutdown()


def scheme(cfg: Any) -> str:
    return "https" if cfg.router.tls_cert else "http"


def client_ca(args: argparse.Namespace, cfg: Any) -> str | None:
    """The CA a command's own client trusts: `--tls-ca`, else (a self-signed) `--tls-cert`."""
    return getattr(args, "tls_ca", None) or cfg.router.tls_cert


def describe_nodes(cfg: Any) -> str:
    if cfg.colocated.num_nodes:
        return f"{cfg.colocated.num_nodes} colocated node(s)"
    return f"{cfg.prefill.num_nodes} prefill + {cfg.decode.num_nodes} decode node(s)"


def cmd_up(args: argparse.Namespace) -> int:
    cfg = service_config(args)
    print(f"starting pdserve: {describe_nodes(cfg)}, "
          f"model {cfg.model.resolved_name()}, k={cfg.spec.num_speculative_tokens} ...", flush=True)
    service, address = start_service(cfg)
    tls = cfg.router.tls_cert is not None
    http = f"; OpenAI-compatible HTTP on {scheme(cfg)}://{service.http_address}/v1" if service.http_address else ""
    every = " (bound on every interface)" if cfg.router.host in ("0.0.0.0", "::", "") else ""
    print(startup_line(service), flush=True)
    print(f"router listening on {address} (gRPC{', TLS' if tls else ''}){http}{every} (Ctrl-C to stop)",
          flush=True)
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    done.wait()
    print("shutting down ...", flush=True)
    shutdown(service)
    return 0


async def _timed_stream(address: str, prompt: str, max_tokens: int, cfg: Any, ca: str | None) -> dict:
    from router.client import RouterClient, build_request

    start = time.perf_counter()
    first = last = 0.0
    text, tokens, usage, reason = [], 0, None, ""
    async with RouterClient(address, cfg.router.api_key, ca) as client:
        async for msg in client.responses(build_request(prompt, chat=True, max_tokens=max_tokens)):
            now = time.perf_counter() - start
            if msg.token_ids:
                first = first or now
                last = now
            tokens += len(msg.token_ids)
            text.append(msg.text)
            if msg.HasField("finished"):
                usage, reason = msg.finished.usage, msg.finished.reason
            if msg.HasField("error"):
                reason = f"error: {msg.error.message}"
    return {"prompt": prompt, "text": "".join(text).strip(), "tokens": tokens, "ttft": first,
            "tpot": (last - first) / max(tokens - 1, 1), "usage": usage, "reason": reason}


def cmd_demo(args: argparse.Namespace) -> int:
    cfg = service_config(args, local=True)
    k = cfg.spec.num_speculative_tokens
    print(f"starting pdserve on a local Ray cluster: {describe_nodes(cfg)}, "
          f"model {cfg.model.resolved_name()}, k={k}, KV over {cfg.kv_transfer.backend} ...", flush=True)
    t0 = time.perf_counter()
    service, address = start_service(cfg)
    print(f"router on {address} (ready in {time.perf_counter() - t0:.1f} s); sending {len(DEMO_PROMPTS)} "
          f"concurrent requests", flush=True)
    try:
        start = time.perf_counter()
        results = asyncio.run(_gather(address, args.max_tokens, cfg, client_ca(args, cfg)))
        wall = time.perf_counter() - start
    finally:
        shutdown(service)
    for r in results:
        u = r["usage"]
        per_step = (r["tokens"] - 1) / u.decode_steps if u is not None and u.decode_steps else 0.0
        print(f"\n> {r['prompt']}\n{r['text']}\n  [{r['tokens']} tokens, {r['reason']}, TTFT {r['ttft'] * 1000:.0f} ms, "
              f"{r['tpot'] * 1000:.0f} ms/token, {per_step:.2f} tokens/decode step with k={k}]")
    total = sum(r["tokens"] for r in results)
    print(f"\n{total} tokens in {wall:.2f} s ({total / wall:.1f} tok/s) through the router and {describe_nodes(cfg)}")
    return 0


async def _gather(address: str, max_tokens: int, cfg: Any, ca: str | None) -> list[dict]:
    return list(await asyncio.gather(*(_timed_stream(address, p, max_tokens, cfg, ca) for p in DEMO_PROMPTS)))


def generate_via_router(args: argparse.Namespace) -> int:
    from router.client import generate_via_router as run

    results = run(args.router, args.prompts, chat=not args.raw, temperature=args.temperature, top_p=args.top_p,
                  top_k=args.top_k, seed=args.seed, max_tokens=args.max_tokens, logprobs=args.logprobs,
                  model=args.model, api_key=args.api_key or settings.API_KEY,
                  tls_ca=args.tls_ca)
    for out in results:
        if args.json:
            print(json.dumps(out))
        else:
            print(f"{out['text']}\n  [{len(out['token_ids'])} tokens, {out['finish_reason']}, "
                  f"{out['stats']['mean_accepted_per_step']:.2f} tokens/step]")
    return 0

