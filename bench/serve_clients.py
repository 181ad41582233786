"""`bench serve`'s load from several client processes, and the CPU time of the service's processes.

One Python process that parses server-sent events with the `openai` client tops out at a few
thousand chunks a second: at saturation it, not the service, would be measured. With
`--client-processes N` each rate's requests are split over N processes (request i goes to process
i mod N, each offering rate / N: N Poisson streams of rate / N make one of rate, and
`--max-concurrency` is split alike); every process is started and its client warmed (serve_load.py) before the clock
starts, all are released together, and their results are merged as one client's.

`CpuWatch` reads the CPU seconds (user + system, every thread) that named processes spent during
a run from /proc/PID/stat (Linux only; elsewhere the figures are missing): the router's share of a
core at saturation, and its microseconds per output token, per SSE chunk (HTTP) or stream message.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench import py_spy
from bench.serve_load import Item, Result, counts, load

START_TIMEOUT_S = 120.0


def proc_cpu_s(pid: int) -> tuple[float, float] | None:
    """CPU seconds (user, system) process `pid` has used so far; None when unreadable."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        tick = os.sysconf("SC_CLK_TCK")
        return int(fields[11]) / tick, int(fields[12]) / tick
    except (OSError, ValueError, IndexError):
        return None


class CpuWatch:
    """CPU seconds of each named process between `start()` and `stop()`; with `spy` (a directory and
    a run's label) each service process is sampled by py-spy over that time too, into
    DIR/LABEL_NAME.txt (bench/py_spy.py; the clients are not)."""

    def __init__(self, pids: dict[str, int], spy: tuple[str, str] | None = None) -> None:
        self.pids = pids
        self.spy = spy
        self._spies: list = []
        self._start: dict[str, tuple[float, float] | None] = {}
        self._t0 = 0.0

    def start(self) -> None:
        if self.spy is not None:
            folder, label = Path(self.spy[0]), self.spy[1]
            folder.mkdir(parents=True, exist_ok=True)
            self._spies = [py_spy.record(pid, folder / f"{label}_{name}.txt") for name, pid in self.pids.items()
                           if not name.startswith("client")]
        self._start = {name: proc_cpu_s(pid) for name, pid in self.pids.items()}
        self._t0 = time.perf_counter()

    def stop(self, tokens: int, chunks: int) -> dict[str, dict[str, float]]:
        """Per process: cpu_s (user + system; sys_s of it in the kernel: socket writes...), share (of
        one core over the run), us_per_token, us_per_chunk."""
        wall = max(time.perf_counter() - self._t0, 1e-9)
        py_spy.stop(self._spies)
        out = {}
        for name, pid in self.pids.items():
            before, after = self._start.get(name), proc_cpu_s(pid)
            if before is None or after is None:
                continue
            cpu, sys_s = sum(after) - sum(before), after[1] - before[1]
            out[name] = {"cpu_s": round(cpu, 3), "sys_s": round(sys_s, 3), "share": round(cpu / wall, 3),
                         "us_per_token": round(1e6 * cpu / tokens, 2) if tokens else float("nan"),
                         "us_per_chunk": round(1e6 * cpu / chunks, 2) if chunks else float("nan")}
        return out


# ---- several client processes -------------------------------------------------------------------
def _client_main(target: dict[str, Any], items: list[Item], rate: float, conn: Any) -> None:
    """A client process: connect, say ready, wait for go, send `items`, send back the results."""
    from bench import serve_load

    ns = argparse.Namespace(**target)

    class _NoBar:
        def update(self, n: int) -> None:
            pass

    async def main() -> list[Any]:
        client = serve_load.sender(ns)
        try:
            await client.warm()
            conn.send("ready")
            await asyncio.to_thread(conn.recv)
            return await serve_load.offer(ns, items, rate, client.send, _NoBar())
        finally:
            await client.close()

    results = asyncio.run(main())
    conn.send([asdict(r) for r in results])


def target_of(args: argparse.Namespace, share: int) -> dict[str, Any]:
    """What a client process needs of the arguments (plain values)."""
    limit = args.max_concurrency
    return {"base_url": args.base_url, "router": args.router, "tls_ca": args.tls_ca,
            "api_key": getattr(args, "api_key", None), "seed": args.seed + share,
            "http_client": getattr(args, "http_client", "openai"),
            "max_concurrency": max(1, limit // args.client_processes) if limit else None}


async def measured_load(args: argparse.Namespace, items: list[Item], rate: float,
                        bar: Any) -> tuple[list[Result], float, dict]:
    """One rate's results, its wall time, and the CPU time of the service's (`args.service_pids`)
    and the clients' processes over that time."""
    spy_dir = getattr(args, "py_spy_dir", None)
    watch = CpuWatch(dict(getattr(args, "service_pids", None) or {}), (spy_dir, f"rate{rate:g}") if spy_dir else None)
    if args.client_processes > 1:
        return await load_processes(args, items, rate, bar, watch)
    watch.pids["client0"] = os.getpid()
    watch.start()
    start = time.perf_counter()
    results = await load(args, items, rate, bar)
    wall = time.perf_counter() - start
    return results, wall, watch.stop(*counts(results))


async def load_processes(args: argparse.Namespace, items: list[Item], rate: float, bar: Any,
                         watch: CpuWatch) -> tuple[list[Result], float, dict]:
    """Results of `items` sent by `args.client_processes` processes, the wall time from their
    release to the last result, and `watch`'s figures over that window (the clients' own too)."""
    n = args.client_processes
    ctx = mp.get_context("spawn")
    conns, procs = [], []
    for i in range(n):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_client_main, args=(target_of(args, i), items[i::n], rate / n, child),
                           name=f"bench-client-{i}", daemon=True)
        proc.start()
        conns.append(parent)
        procs.append(proc)
    try:
        for conn in conns:
            if not await asyncio.to_thread(conn.poll, START_TIMEOUT_S):
                raise TimeoutError("a client process did not start")
            conn.recv()
        watch.pids.update({f"client{i}": p.pid for i, p in enumerate(procs) if p.pid is not None})
        watch.start()
        start = time.perf_counter()
        for conn in conns:
            conn.send("go")
        shares = await asyncio.gather(*(asyncio.to_thread(conn.recv) for conn in conns))
        wall = time.perf_counter() - start
        results = [Result(**r) for share in shares for r in share]
        cpu = watch.stop(*counts(results))  # before the clients exit: their /proc entries go with them
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    bar.update(len(results))
    return results, wall, cpu
