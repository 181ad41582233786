"""`pdserve bench pd`'s default mode: every node in its own process, driven through the router.

Each node is the real node class behind its real gRPC server (prefill_node/server.py,
decode_node/server.py), started as a child process (multiprocessing `spawn`: no interpreter, no
CUDA context shared with this one) on its own device; prefill and decode exchange KV over
`--kv-backend` (tcp or ucx) and the first-token message over gRPC, as in the service. This
process runs the router (router/router.py, as plain objects, no Ray) over a directory of those
nodes, and submits the requests to it exactly as its gRPC servicer would (`Router.submit`,
`Router.responses`), so the disaggregated pair and the colocated node are measured through the
same client path, one after the other on a fresh set of processes each.

The TTFT breakdown reads the nodes' event times (prefill: queued, started, computed,
first_sent; decode: first_received, kv_done, inserted), which each child sends back when it is
told to stop; they are CLOCK_MONOTONIC readings, comparable across processes of one host.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import time
from contextlib import aclosing
from typing import Any

START_TIMEOUT_S = 300.0


# ---------------------------------------------------------------- a node process


def node_main(role: str, args: argparse.Namespace, device: str, conn: Any) -> None:
    """A child process: load the model, build the node, serve it on 127.0.0.1, send ("ready",
    port); on any message, stop and send back the node's event times."""
    from bench.engine import load
    from bench.pd_schedule import node_config

    loaded = load(args, device)
    cfg = node_config(args, device)
    node: Any
    if role == "prefill":
        from prefill_node.node import PrefillNode
        from prefill_node.server import DecodeClients, serve_prefill

        clients = DecodeClients(timeout_s=30)
        node = PrefillNode(loaded, cfg, clients.send_first_token, kv_backend=args.kv_backend, kv_timeout_s=30)
        serve: Any = serve_prefill
    elif role == "decode":
        from decode_node.node import DecodeNode
        from decode_node.server import serve_decode

        kv_options = {"host": "127.0.0.1"} if args.kv_backend == "tcp" else None
        node = DecodeNode(loaded, cfg, kv_backend=args.kv_backend, kv_timeout_s=30, kv_options=kv_options)
        serve = serve_decode
    else:
        from decode_node.colocated import ColocatedNode
        from decode_node.server import serve_colocated

        node, serve = ColocatedNode(loaded, cfg), serve_colocated
    node.timings = {}  # per-request event times, for the TTFT breakdown
    node.start()
    server, port = serve(node, f"bench-{role}", "127.0.0.1")
    conn.send(("ready", port))
    conn.recv()
    timings = node.timings
    server.stop(grace=1)
    node.stop()
    conn.send(timings)


class NodeProcs:
    """Node processes of `roles` (each on its device); `addresses` once all serve."""

    def __init__(self, args: argparse.Namespace, roles: dict[str, str]) -> None:
        if args.kv_backend == "ucx":
            from kvtransfer.ucx import restrict_to_loopback

            restrict_to_loopback("127.0.0.1")  # the children inherit it: UCX on loopback only
        ctx = mp.get_context("spawn")
        self.procs: dict[str, Any] = {}
        self.conns: dict[str, Any] = {}
        for role, device in roles.items():
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=node_main, args=(role, args, device, child), name=f"bench-{role}", daemon=True)
            proc.start()
            self.procs[role], self.conns[role] = proc, parent
        self.addresses = {role: f"127.0.0.1:{self._ready(role)}" for role in roles}

    def _ready(self, role: str) -> int:
        conn, deadline = self.conns[role], time.monotonic() + START_TIMEOUT_S
        while not conn.poll(0.2):
            if not self.procs[role].is_alive():
                raise RuntimeError(f"the {role} node process exited ({self.procs[role].exitcode}) before serving")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the {role} node process did not serve within {START_TIMEOUT_S:g} s")
        what, port = conn.recv()
        assert what == "ready"
        return int(port)

    def stop(self) -> dict[str, dict[str, dict[str, float]]]:
        """Stop every node; their event times by role."""
        timings: dict[str, dict[str, dict[str, float]]] = {}
        for role, conn in self.conns.items():
            try:
                conn.send("stop")
                timings[role] = conn.recv() if conn.poll(30) else {}
            except (OSError, EOFError):
                timings[role] = {}
        for proc in self.procs.values():
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
        return timings


# ---------------------------------------------------------------- the router and its client


def model_info(args: argparse.Namespace) -> Any:
    """What the router needs of the model (no weights)."""
    from bench.engine import model_info as info

    return info(args)


async def drive(args: argparse.Namespace, directory: Any, times: list[float], prompts: list[list[int]],
                background: list[list[int]]) -> dict[str, Any]:
    """The bench's schedule through a router over `directory`; the traces (bench.pd.Trace)."""
    from bench.pd_schedule import WARMUP_ITEMS, Trace, node_config
    from deploy.config import RouterConfig
    from router.router import Router

    config = RouterConfig(host="127.0.0.1", port=0, http_port=None, status_interval_s=0.5, rpc_timeout_s=30,
                          default_timeout_s=3600, queue_size=4 * (len(prompts) + len(background)))
    max_len = node_config(args, "cpu").max_model_len
    router = Router(model_info(args), directory, config, max_model_len=max_len,
                    num_speculative_tokens=args.spec_tokens)
    await router.start(port=0, host="127.0.0.1", http_port=None)
    traces: dict[str, Trace] = {}
    tasks: list[asyncio.Task[None]] = []
    try:
        await _wait_serving(router)
        for i, p in enumerate(background):
            tasks.append(_start(router, f"bg{i}", p, args.background_tokens, traces))
        await _until(lambda: all(len(traces[f"bg{i}"].items) >= WARMUP_ITEMS for i in range(len(background))))
        start = time.monotonic()
        for i, (t, p) in enumerate(zip(times, prompts, strict=True)):
            await asyncio.sleep(max(0.0, start + t - time.monotonic()))
            tasks.append(_start(router, f"r{i}", p, args.output_len, traces))
        await _until(lambda: all(f"r{i}" in traces and traces[f"r{i}"].ended for i in range(len(prompts))))
        for i in range(len(background)):
            await router.abort(f"bg{i}")
        await asyncio.wait_for(asyncio.gather(*tasks), 120)
        traces["_start"] = Trace(submitted=start)
        return {"traces": traces, "router_id": router.router_id}
    finally:
        for task in tasks:
            task.cancel()
        await router.stop()


def _start(router: Any, rid: str, prompt: list[int], max_tokens: int, traces: dict[str, Any]) -> asyncio.Task[None]:
    from bench.pd_schedule import Trace

    traces[rid] = Trace(submitted=time.monotonic())
    return asyncio.create_task(_one(router, rid, prompt, max_tokens, traces[rid]))


async def _one(router: Any, rid: str, prompt: list[int], max_tokens: int, tr: Any) -> None:
    from router.client import build_request

    st = await router.submit(build_request(prompt, max_tokens=max_tokens, ignore_eos=True, request_id=rid))
    async with aclosing(router.responses(st)) as msgs:
        async for msg in msgs:
            now = time.monotonic()
            tokens = list(msg.token_ids)
            if tokens and tr.first is None:
                tr.first, tokens = now, tokens[1:]
                tr.tokens += msg.token_ids[:1]
            if tokens:
                tr.items.append((now, len(tokens)))
                tr.tokens += tokens
            if msg.HasField("error"):
                raise RuntimeError(f"request {rid} failed: {msg.error.code} {msg.error.message}")
    tr.ended = True


async def _wait_serving(router: Any) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while not router.health().serving:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the router saw no usable nodes: {router.health()}")
        await router.refresh()
        await asyncio.sleep(0.1)


async def _until(cond: Any, timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError("requests did not finish in time")
        await asyncio.sleep(0.002)


# ---------------------------------------------------------------- the two runs


Events = dict[str, dict[str, float]]  # request id -> {event: monotonic time}


def run_pd(args: argparse.Namespace, times: list[float], prompts: list[list[int]],
           background: list[list[int]]) -> tuple[dict[str, Any], Events, Events]:
    """The disaggregated run: traces, and the prefill and decode nodes' events by request id."""
    from router.directory import NodeDirectory

    procs = NodeProcs(args, {"prefill": args.prefill_device, "decode": args.decode_device})
    try:
        directory = NodeDirectory(prefill=[procs.addresses["prefill"]], decode=[procs.addresses["decode"]])
        out = asyncio.run(drive(args, directory, times, prompts, background))
    finally:
        timings = procs.stop()
    traces, router_id = out["traces"], out["router_id"]

    def by_rid(role: str) -> Events:  # node request ids are router/request/attempt
        return {rid.split("/")[1]: ev for rid, ev in timings.get(role, {}).items() if rid.startswith(f"{router_id}/")}

    return traces, by_rid("prefill"), by_rid("decode")


def run_colocated(args: argparse.Namespace, times: list[float], prompts: list[list[int]],
                  background: list[list[int]]) -> dict[str, Any]:
    from router.directory import NodeDirectory

    procs = NodeProcs(args, {"colocated": args.colocated_device or args.decode_device})
    try:
        out = asyncio.run(drive(args, NodeDirectory(colocated=[procs.addresses["colocated"]]), times, prompts,
                                background))
    finally:
        procs.stop()
    traces: dict[str, Any] = out["traces"]
    return traces
