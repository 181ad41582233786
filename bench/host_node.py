"""The real colocated node behind `pdserve bench host --node-model M`, and where its CPU goes.

Receives the model (`tiny` on a CPU: engine/model/tiny.py), k and the batch size; runs a real
ColocatedNode (decode_node/colocated.py: its step loop, chunked prefill, MTP decode, output items,
publishing to the owners' streams) behind the real servicer (decode_node/server.py), in its own
process, with torch on one thread so the model's compute runs on the loop thread alone. Hands back,
on request over its pipe, a `NodeMeter` reading: the process's CPU seconds (every thread), the
loop thread's, the loop thread's inside the runner's model calls (`launch_decode`, `prefill`: the
model's compute, which on a CPU runs inside the launch), the decode read point's (`collect`: on a
GPU it waits for the step) and the rounds' prefill part as a whole (`ChunkedPrefill.launch` and
`finish`: its compute, its first tokens' read, the inserts).
The rest of the process's CPU, the host path, is the node's cost per output token that does not
shrink with a faster device: the loop's bookkeeping around the model, output items, packing, the
gRPC stream writes.

Measures; never changes what the node does (the wrappers only read clocks).
"""

from __future__ import annotations

import functools
import os
import re
import threading
import time
from typing import Any


class NodeMeter:
    """CPU seconds of a node process: all of it, its loop thread, and the model calls in that thread."""

    def __init__(self) -> None:
        self.loop_cpu_s = 0.0
        self.compute_cpu_s = 0.0
        self.read_cpu_s = 0.0
        self.prefill_cpu_s = 0.0  # the whole prefill part of a round: its compute, its first tokens' read, inserts
        self.steps = 0
        self._lock = threading.Lock()

    def wrap(self, node: Any) -> None:
        """Time `node.step` (loop thread CPU) and the runner's model calls (compute) from now on."""
        node.step = self._timed(node.step, "loop_cpu_s", count=True)
        for name in ("launch_decode", "prefill"):
            setattr(node.runner, name, self._timed(getattr(node.runner, name), "compute_cpu_s"))
        node.runner.collect = self._timed(node.runner.collect, "read_cpu_s")
        for name in ("launch", "finish"):  # the round's prefill: queued before its decode step, read after
            setattr(node.prefill, name, self._timed(getattr(node.prefill, name), "prefill_cpu_s"))

    def _timed(self, fn: Any, counter: str, count: bool = False) -> Any:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                spent = time.thread_time() - start
                with self._lock:
                    setattr(self, counter, getattr(self, counter) + spent)
                    self.steps += count
        return timed

    def read(self) -> dict[str, Any]:
        with self._lock:
            return {"process_cpu_s": time.process_time(), "loop_cpu_s": self.loop_cpu_s,
                    "compute_cpu_s": self.compute_cpu_s, "read_cpu_s": self.read_cpu_s,
                    "prefill_cpu_s": self.prefill_cpu_s, "loop_rounds": self.steps, "threads": thread_cpu_s()}


def thread_cpu_s() -> dict[str, float]:
    """CPU seconds of this process's threads by kind: Python threads by name (digits dropped:
    `ThreadPoolExecutor-0_` is the gRPC servicer's pool), the others by their OS name (gRPC core's
    `event_engine`...). Linux only (empty elsewhere)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for tid in os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else []:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                comm, _, rest = f.read().partition(" (")[2].rpartition(") ")
            fields = rest.split()
        except OSError:
            continue
        name = names.get(int(tid)) or comm
        kind = re.sub(r"\d+", "", name).rstrip("_-") or name
        out[kind] = out.get(kind, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def split(before: dict[str, Any], after: dict[str, Any], tokens: int) -> dict[str, Any]:
    """The node's CPU between two readings, in us per output token: all, model compute, host path
    (all - compute), and the host path's parts: the loop thread's and the other threads' (gRPC)."""
    d = {k: after[k] - before[k] for k in after if k != "threads"}
    threads = {k: round(1e6 * (v - before["threads"].get(k, 0.0)) / tokens, 1) if tokens else float("nan")
               for k, v in after["threads"].items()}
    per = lambda s: round(1e6 * s / tokens, 1) if tokens else float("nan")  # noqa: E731
    return {"tokens": tokens, "loop_rounds": int(d["loop_rounds"]), "cpu_s": round(d["process_cpu_s"], 3),
            "us_per_token": per(d["process_cpu_s"]), "compute_us_per_token": per(d["compute_cpu_s"]),
            "host_us_per_token": per(d["process_cpu_s"] - d["compute_cpu_s"]),
            "loop_host_us_per_token": per(d["loop_cpu_s"] - d["compute_cpu_s"]),
            "read_point_us_per_token": per(d["read_cpu_s"]),  # of the loop's: the decode read point (a wait on a GPU)
            "prefill_round_us_per_token": per(d["prefill_cpu_s"]),  # compute included; its first-token read waits
            "other_threads_us_per_token": per(d["process_cpu_s"] - d["loop_cpu_s"]),
            "threads_us_per_token": {k: v for k, v in sorted(threads.items(), key=lambda kv: -kv[1]) if v > 0}}


def node_main(options: dict, conn: Any) -> None:
    """A node process: build and serve the node, say ready, answer "meter" until "stop"."""
    import torch

    from decode_node.colocated import ColocatedNode
    from decode_node.server import serve_colocated
    from deploy.actors import freeze_node_heap
    from engine.engine import EngineConfig
    from engine.model.loader import load_model

    torch.set_num_threads(1)  # the model's compute on the loop thread only: the split is exact
    config = EngineConfig(num_speculative_tokens=options["k"], max_num_seqs=options["max_num_seqs"],
                          max_num_batched_tokens=options["max_num_batched_tokens"],
                          kv_cache_bytes=options["kv_cache_bytes"], device=options["device"])
    node = ColocatedNode(load_model(options["model"], device=options["device"]), config)
    freeze_node_heap()  # as deploy/actors.py does
    meter = NodeMeter()
    meter.wrap(node)
    node.start()
    server, port = serve_colocated(node, "bench-node", "127.0.0.1")
    conn.send(("ready", f"127.0.0.1:{port}"))
    while conn.recv() == "meter":
        conn.send(meter.read())
    server.stop(grace=1)
    node.stop()
    conn.send({"steps": meter.steps})
