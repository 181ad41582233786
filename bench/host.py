"""`pdserve bench host`: the host path alone (router -> client), with no model in the way.

Receives the shape of a load (requests, output length, concurrency, client processes, HTTP or gRPC)
and of the nodes' pace (`--step-ms`, tokens per step); starts `--nodes` synthetic colocated nodes
(decode_node/synthetic.py: the real servicer and output stream, no compute: every step gives each
running request k + 1 tokens) and one router (router/router.py with its HTTP door, plain objects),
each in its own process, loads the router through `bench serve`'s client (several processes) and
hands back `bench serve`'s report plus, per run, the CPU time of every process: the router's share
of a core and its microseconds per output token, per SSE event (or gRPC message), and per node
message (one per node step), and the output tokens/s one router core could carry at that cost.

The tokenizer is the model's (`--model`, smollm2 by default: detokenization is real work); the
tokens are the prompt's own ids cycled, so the text is real text.

`--node-model M` (`tiny` on a CPU) puts one REAL colocated node there instead (bench/host_node.py:
the node's step loop, model, output items and stream writes) and reports, per run, the node
process's CPU per output token split into the model's compute and the host path (`node` in each
run; the router uses M's tokenizer). `--node-py-spy FILE` samples that node process.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import time
from pathlib import Path
from typing import Any

from bench import py_spy

START_TIMEOUT_S = 120.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2", help="whose tokenizer the router uses (no weights are loaded)")
    p.add_argument("--spec-tokens", type=int, default=3, help="k: a node step gives k + 1 tokens per request")
    p.add_argument("--step-ms", type=float, default=3.0, help="a node step's time (H100 SmolLM2 at batch 128: ~3)")
    p.add_argument("--nodes", type=int, default=1, help="synthetic colocated nodes")
    p.add_argument("--routers", type=int, default=1, help="router processes sharing the ports (router.processes)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="requests running at once per node")
    p.add_argument("--protocol", choices=("http", "grpc"), default="http")
    p.add_argument("--http-client", choices=("openai", "raw"), default="openai", help="as bench serve's")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--client-processes", type=int, default=2)
    p.add_argument("--repeat", type=int, default=2, help="runs (the first warms up the router)")
    p.add_argument("--json", default=None, metavar="FILE", help="write the report here")
    p.add_argument("--py-spy", default=None, metavar="FILE", help="sample the router with py-spy (on PATH or "
                   "beside this Python) over the load; collapsed stacks (flamegraph.pl's input) to FILE")
    p.add_argument("--node-model", default=None, help="run one real colocated node with this model (e.g. tiny, "
                   "on the CPU) instead of synthetic nodes, and split its CPU per token (bench/host_node.py)")
    p.add_argument("--max-num-batched-tokens", type=int, default=512, help="--node-model: prefill tokens per round")
    p.add_argument("--kv-cache-bytes", type=int, default=256 << 20, help="--node-model: the node's KV cache")
    p.add_argument("--node-device", default="cpu", help="--node-model: the node's device (cpu, cuda)")
    p.add_argument("--node-py-spy", default=None, metavar="FILE", help="--node-model: sample the node process "
                   "with py-spy over the load (every thread); collapsed stacks to FILE")


def run(args: argparse.Namespace) -> int:
    nodes, router, spies = _Procs(), _Procs(), []
    if args.node_model:
        args.model = args.node_model  # the router's tokenizer and vocabulary are the node's
    try:
        addresses = _start_nodes(args, nodes)
        options = {"model": args.model, "colocated": addresses, "queue_size": 4 * args.num_prompts,
                   "processes": args.routers, "ports": None}
        ports = router.start(_router_main, options, "router")
        for i in range(1, args.routers):  # the same ports (SO_REUSEPORT): clients' connections spread
            router.start(_router_main, {**options, "ports": ports}, f"router{i}")
        spies = [py_spy.record(pid, out, idle=False) for out, pid in ((args.py_spy, router.pids["router"]),
                                                                      (args.node_py_spy, nodes.pids["node0"])) if out]
        report = asyncio.run(_runs(args, ports, {**nodes.pids, **router.pids}, nodes))
    finally:
        py_spy.stop(spies)
        router.stop()
        stats = nodes.stop()
    report["node_messages"] = sum(s.get("steps", 0) for s in stats)
    for r in report["runs"]:
        _per_message(r, report["node_messages"] / len(report["runs"]))
    text = json.dumps(report, indent=2)
    if args.json:
        Path(args.json).write_text(text + "\n")
    print(_table(report))
    return 0


def _start_nodes(args: argparse.Namespace, nodes: _Procs) -> list[str]:
    if args.node_model:
        from bench.host_node import node_main

        options = {"model": args.node_model, "k": args.spec_tokens, "max_num_seqs": args.max_num_seqs,
                   "max_num_batched_tokens": args.max_num_batched_tokens, "kv_cache_bytes": args.kv_cache_bytes,
                   "device": args.node_device}
        return [nodes.start(node_main, options, "node0")]
    return [nodes.start(_node_main, dict(vocab_of(args.model), k=args.spec_tokens, step_s=args.step_ms / 1000,
                                         max_num_seqs=args.max_num_seqs), f"node{i}") for i in range(args.nodes)]


async def _runs(args: argparse.Namespace, ports: dict, pids: dict[str, int], nodes: _Procs) -> dict:
    """`--repeat` runs; with a real node each run is loaded alone, between two readings of its meter."""
    if not args.node_model:
        return await _load(args, ports, pids, args.repeat)
    from bench.host_node import split

    report: dict = {}
    runs = []
    for _ in range(args.repeat):
        before = await asyncio.to_thread(nodes.ask, "node0", "meter")
        report = await _load(args, ports, pids, 1)
        after = await asyncio.to_thread(nodes.ask, "node0", "meter")
        r = report["runs"][0]
        r["node"] = split(before, after, round(r["output_throughput"] * r["duration_s"]))
        runs.append(r)
    report["runs"] = runs
    return report


def vocab_of(model: str) -> dict[str, int]:
    from engine.model.info import load_model_info

    return {"vocab": load_model_info(model).config.vocab_size}


async def _load(args: argparse.Namespace, ports: dict, pids: dict[str, int], repeat: int) -> dict:
    from bench import serve

    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    target = ["--base-url", f"http://127.0.0.1:{ports['http']}"] if args.protocol == "http" else \
        ["--router", f"127.0.0.1:{ports['grpc']}"]
    ns = p.parse_args([*target, "--num-prompts", str(args.num_prompts), "--output-len", str(args.output_len),
                       "--client-processes", str(args.client_processes), "--http-client", args.http_client])
    ns.max_concurrency, ns.service_pids = args.max_concurrency, pids
    items = serve.load_dataset(ns)
    report = await serve.sweep(ns, items, [float("inf")] * repeat)
    for r in report["runs"]:
        r.pop("samples")
    return report


def _per_message(run: dict, node_messages: float) -> None:
    """Add `routers` (every router process together), its us per node message (node steps are the
    same in every run: an estimate) and the output tokens/s one router core carries at its cost."""
    parts = [v for k, v in run["cpu"].items() if k.startswith("router")]
    if parts:
        total = {key: round(sum(p[key] for p in parts), 3) for key in ("cpu_s", "sys_s", "share", "us_per_token",
                                                                        "us_per_chunk")}
        cpu = run["cpu"]["routers"] = total
        cpu["us_per_node_message"] = round(1e6 * cpu["cpu_s"] / node_messages, 1) if node_messages else None
        cpu["tokens_per_s_per_core"] = round(1e6 / cpu["us_per_token"]) if cpu["us_per_token"] > 0 else None


def _table(report: dict) -> str:
    rows = ["run | out tok/s | routers' share | routers' us/token | us/chunk | tok/s per router core | clients share"]
    for i, r in enumerate(report["runs"]):
        c, clients = r["cpu"].get("routers", {}), [v["share"] for k, v in r["cpu"].items() if k.startswith("client")]
        rows.append(f"{i} | {r['output_throughput']:,.0f} | {c.get('share')} | {c.get('us_per_token')} | "
                    f"{c.get('us_per_chunk')} | {c.get('tokens_per_s_per_core')} | {sum(clients):.2f}")
    if any("node" in r for r in report["runs"]):
        rows += ["", "run | node share | node us/token | compute | host path | host: loop thread (read point) | "
                 "host: other threads | tokens/round"]
        for i, r in enumerate(report["runs"]):
            n, share = r["node"], r["cpu"].get("node0", {}).get("share")
            rows.append(f"{i} | {share} | {n['us_per_token']} | {n['compute_us_per_token']} | "
                        f"{n['host_us_per_token']} | {n['loop_host_us_per_token']} ({n['read_point_us_per_token']}) | "
                        f"{n['other_threads_us_per_token']} | {n['tokens'] / max(n['loop_rounds'], 1):.1f}")
    return "\n".join(rows)


# ---- child processes ----------------------------------------------------------------------------
class _Procs:
    """Child processes (spawned) that each send ("ready", info) and then wait for "stop"."""

    def __init__(self) -> None:
        self.conns: list[Any] = []
        self.procs: list[Any] = []
        self.pids: dict[str, int] = {}

    def start(self, target: Any, options: dict, name: str) -> Any:
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=target, args=(options, child), name=f"bench-{name}", daemon=True)
        proc.start()
        self.conns.append(parent)
        self.procs.append(proc)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not parent.poll(0.2):
            if not proc.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"{name} did not start (exit code {proc.exitcode})")
        what, info = parent.recv()
        assert what == "ready" and proc.pid is not None
        self.pids[name] = proc.pid
        return info

    def ask(self, name: str, what: str) -> Any:
        """Send `what` to child `name` and return its answer."""
        conn = self.conns[list(self.pids).index(name)]
        conn.send(what)
        return conn.recv()

    def stop(self) -> list[dict]:
        out = []
        for conn in self.conns:
            try:
                conn.send("stop")
                out.append(conn.recv() if conn.poll(30) else {})
            except (OSError, EOFError):
                out.append({})
        for proc in self.procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
        return out


def _node_main(options: dict, conn: Any) -> None:
    from decode_node.server import serve_colocated
    from decode_node.synthetic import SyntheticNode

    node = SyntheticNode(**options)
    node.start()
    server, port = serve_colocated(node, "synthetic", "127.0.0.1")
    conn.send(("ready", f"127.0.0.1:{port}"))
    conn.recv()
    server.stop(grace=1)
    node.stop()
    conn.send({"steps": node.steps, "tokens": node.tokens})


def _router_main(options: dict, conn: Any) -> None:
    import uvloop

    uvloop.run(_serve_router(options, conn))  # the loop Ray gives the router actor (deploy/router_actor.py)


async def _serve_router(options: dict, conn: Any) -> None:
    from deploy.config import RouterConfig
    from engine.model.info import load_model_info
    from router import NodeDirectory, Router
    from router.router import freeze_heap

    ports = options["ports"] or {"grpc": 0, "http": 0}
    config = RouterConfig(host="127.0.0.1", port=ports["grpc"], http_port=ports["http"], queue_size=options["queue_size"],
                          status_interval_s=1.0, processes=options["processes"])
    router = Router(load_model_info(options["model"]), NodeDirectory(colocated=options["colocated"]), config)
    grpc_port = await router.start()
    freeze_heap()  # as deploy/router_actor.py does
    conn.send(("ready", {"grpc": grpc_port, "http": router.http_port}))
    await asyncio.to_thread(conn.recv)
    await router.stop()
    conn.send({})
