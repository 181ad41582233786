"""``pdserve bench kv``: KV transfer bandwidth between two processes, against the raw transport.

The parent process is the sender, a spawned child the receiver (on GPU: cuda:0 and
cuda:1). Each layer's cache is one block-major tensor ``[blocks, block_bytes]``; the
request's blocks are contiguous, so a layer is one message. Timed: from ``start``
to the sender seeing DONE (the receiver's ack), median over ``--iters`` after a
warm-up. ``intact``: the receiver's destination bytes hash equal to the source's
on every iteration; before each, every source byte changes (+1 mod 256, as a prefill
rewrites its cache), so a run that did not land shows. On CPU the rewrite runs in numpy on
the calling thread: torch's ``add_`` leaves its OpenMP worker spinning for a while after each
call (libgomp's default spin count; seen in ``perf``), a neighbour that perftest does not
have. Measured on 2 cores, the spinner moved our time per 64 MiB by less than the run-to-run
noise (10.5-12.0 ms with it, 9.3-12.5 without) but made a bare ucxx loop faster (7.0-7.2 vs
8.8-10.0 ms), since it keeps a vCPU from halting; neither flatters us. Rewriting the source
at all cost nothing measurable either (no rewrite: 10.6-11.4 ms), so every transfer is still
checked byte for byte. The destination is not cleared:
zeroing 64 MiB leaves the last-level cache full of its dirty lines, whose write-back then
lands inside the timed transfer (~1.5x slower here); a decode node's destination blocks
were last written long before.

``--inflight N`` starts N transfers at once (each into its own blocks, all layers queued)
and reports the time per transfer: throughput with several requests' KV moving, as on a
loaded decode node, and closer to perftest's steady state (it posts the next message
before the previous one completed, and neither process ever sleeps).

Raw figures measured in the same run, interleaved: ``--rounds`` times, ``--iters``
transfers (their median) then the raw figure; reported are per-round figures and
the medians over rounds (``ratio``: median of the per-round ratios). ucx:
``ucx_perftest -t tag_bw`` between two processes with the same memory type, at our
message size (``raw_gbps``; it re-sends one buffer, so at 2 MiB its source and
destination stay in the CPU caches) and as one message of the whole transfer
(``raw_transfer_gbps``), and that again with resident buffers (``raw_resident_gbps``, CPU
only, where a C compiler is found): perftest never writes its buffers, so its source pages
are the kernel's shared zero page, which stays in the CPU caches (see ``_RESIDENT_SHIM``);
``ratio_resident`` compares like with like, both sides moving resident memory. tcp, local: a
plain memcpy of the same bytes. On GPU, each perftest process sees only its own GPU (see
``_two_gpus``), and ``d2d_gbps`` is a torch copy cuda:0 -> cuda:1.

CPU caches are allocated in transparent huge pages (``--no-thp``: 4 KiB pages). CMA,
the shared-memory zero-copy path, pins pages per message, so the page size moves both
figures ~2x; perftest is therefore given the same kind of memory (``UCX_ALLOC_PRIO``:
``thp,mmap,heap``, or ``mmap,heap`` with ``--no-thp``). Its default, SysV shared
memory, gets 4 KiB pages where no huge pages are reserved, and would flatter the ratio
of a THP run ~2x.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import math
import mmap
import multiprocessing as mp
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from typing import Any

import msgpack
import torch

os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", choices=["ucx", "tcp", "ipc", "local"], default="ucx")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--planes", type=int, default=1,
                        help="planes per layer (2: K and V apart, as the engine's cache)")
    parser.add_argument("--blocks", type=int, default=256)
    parser.add_argument("--block-bytes", type=int, default=8192)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3,
                        help="alternate our transfers and the raw figure this many times")
    parser.add_argument("--thp", action=argparse.BooleanOptionalAction, default=True,
                        help="CPU caches in transparent huge pages (as UCX allocates perftest's)")
    parser.add_argument("--inflight", type=int, default=1,
                        help="transfers in flight at once, each into its own blocks (throughput)")
    parser.add_argument("--verify-every", type=int, default=1,
                        help="compare the destination with the source every N-th transfer (and the last "
                        "of each round); the others run back to back, as on a busy node, where the "
                        "GPUs' clocks stay up between transfers")
    parser.add_argument("--isolate", action="store_true",
                        help="cuda: each process sees only its own GPU (as Ray gives each node actor)")
    parser.add_argument("--json", action="store_true")


def _device(args: argparse.Namespace, rank: int) -> torch.device:
    if args.device == "cpu":
        return torch.device("cpu")
    return torch.device("cuda", rank % torch.cuda.device_count())


_HUGE = 2 << 20
_mappings: list[mmap.mmap] = []  # keep the huge-page mappings of this process alive


def _huge_page_tensor(shape: tuple[int, ...]) -> torch.Tensor:
    """A zeroed uint8 tensor in 2 MiB-aligned anonymous memory advised MADV_HUGEPAGE."""
    nbytes = math.prod(shape)
    m = mmap.mmap(-1, nbytes + _HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    _mappings.append(m)
    base = torch.frombuffer(m, dtype=torch.uint8)
    offset = -base.data_ptr() % _HUGE
    m.madvise(mmap.MADV_HUGEPAGE, offset, nbytes - nbytes % mmap.PAGESIZE)
    return base[offset : offset + nbytes].view(shape)


def _cache(args: argparse.Namespace, device: torch.device, fill: bool) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shape = (args.planes, args.blocks * args.inflight, args.block_bytes)
    layers = []
    for _ in range(args.layers):
        t = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8) if fill else None
        if device.type == "cpu" and args.thp:
            dst = _huge_page_tensor(shape)
            layers.append(dst.copy_(t) if t is not None else dst)
        else:
            layers.append((t if t is not None else torch.zeros(shape, dtype=torch.uint8)).to(device))
    return layers


def _digest(cache: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in cache:
        h.update(t.cpu().numpy().tobytes())
    return h.hexdigest()


def _receiver_main(conn: Connection, args: argparse.Namespace) -> None:
    from kvtransfer import KVLayout, create_receiver

    if args.isolate:  # before CUDA starts in this process
        os.environ["CUDA_VISIBLE_DEVICES"] = _two_gpus()[0]
    device = _device(args, 1)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    cache = _cache(args, device, fill=False)
    receiver = create_receiver(args.backend, timeout_s=60)
    receiver.register(KVLayout(cache, 1))
    while (cmd := msgpack.unpackb(conn.recv_bytes(), raw=False))["op"] != "exit":
        if cmd["op"] == "expect":
            first = cmd.get("slot", 0) * args.blocks
            blocks = list(range(first, first + args.blocks))
            reply: Any = receiver.expect(cmd["rid"], blocks, list(range(args.layers)))
        elif cmd["op"] == "wait":
            reply = receiver.wait(cmd["rid"], 60).state.value
        else:
            reply = _digest(cache)
        conn.send_bytes(msgpack.packb(reply, use_bin_type=True))
    receiver.close()


def _call(conn: Connection, op: str, **kw: Any) -> Any:
    conn.send_bytes(msgpack.packb({"op": op, **kw}, use_bin_type=True))
    return msgpack.unpackb(conn.recv_bytes(), raw=False)


def _one_transfer(sender: Any, conn: Connection, args: argparse.Namespace, rid: str,
                  cache: list[torch.Tensor], verify: bool = True) -> tuple[float, bool]:
    """One timed transfer of a changed source (``--inflight`` N: N at once, each into its own
    blocks; the time is per transfer); (seconds, destination equals source)."""
    for t in cache:
        if t.is_cuda:
            t.add_(1)
        else:  # numpy: one thread, no OpenMP workers left spinning (see the module docstring)
            a = t.numpy()
            a += 1
    if cache[0].is_cuda:
        torch.cuda.synchronize(cache[0].device)
    rids = [rid if args.inflight == 1 else f"{rid}.{i}" for i in range(args.inflight)]
    descs = [_call(conn, "expect", rid=r, slot=i) for i, r in enumerate(rids)]
    blocks = [list(range(i * args.blocks, (i + 1) * args.blocks)) for i in range(args.inflight)]
    t0 = time.perf_counter()
    for r, desc in zip(rids, descs, strict=True):
        sender.start(r, desc)
    for layer in range(args.layers):
        for r, b in zip(rids, blocks, strict=True):
            sender.send_layer(r, layer, b)
    for r in rids:
        sender.finish(r)
    statuses = [sender.wait(r, 120) for r in rids]
    elapsed = (time.perf_counter() - t0) / args.inflight
    for r, status in zip(rids, statuses, strict=True):
        if status.state.value != "done" or _call(conn, "wait", rid=r) != "done":
            raise RuntimeError(f"transfer {r} ended {status}")
    return elapsed, not verify or _call(conn, "digest") == _digest(cache)


def _transfer_figures(args: argparse.Namespace, raw: Any) -> dict[str, Any]:
    """Per round: ``--iters`` timed transfers (their median), then ``raw()``'s figures."""
    from kvtransfer import KVLayout, create_sender

    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver_main, args=(child, args), daemon=True)
    proc.start()
    if args.isolate:
        os.environ["CUDA_VISIBLE_DEVICES"] = _two_gpus()[1]
    device = _device(args, 0)
    cache = _cache(args, device, fill=True)
    sender = create_sender(args.backend, timeout_s=60)
    sender.register(KVLayout(cache, 1))
    rounds: list[dict[str, Any]] = []
    intact, n = True, 0
    try:
        for r in range(-1, args.rounds):  # round -1: one warm-up transfer
            times = []
            iters = args.iters if r >= 0 else 1
            for i in range(iters):
                verify = i == iters - 1 or i % args.verify_every == 0
                seconds, same = _one_transfer(sender, conn, args, f"bench-{n}", cache, verify)
                times.append(seconds)
                intact = intact and same
                n += 1
            if r >= 0:
                rounds.append({"seconds": statistics.median(times), **raw()})
        messages = sender.messages // (n * args.inflight)  # type: ignore[attr-defined]
    finally:
        sender.close()
        conn.send_bytes(msgpack.packb({"op": "exit"}))
        proc.join(30)
    return {"rounds": rounds, "messages": messages, "intact": intact}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ucx_perftest never writes its host buffers, so their pages are never faulted in: CMA reads
# the sender's "64 MiB" from the kernel's one shared zero page (2 MiB with THP), which stays in
# the CPU caches, and only the destination goes to DRAM. A KV cache is real, resident memory.
# Preloaded into both perftest processes, this library writes one byte of every 4 KiB page of
# each buffer as UCX allocates it (after madvise(MADV_HUGEPAGE) for THP, after a large
# anonymous mmap for 4 KiB pages), which makes perftest move resident memory, as we do.
# RESIDENT_SHIM_TOUCH (set here for the two processes, not by a user) says which of the two.
_RESIDENT_SHIM = r"""
#define _GNU_SOURCE
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

static int touching(const char *mode) {
    const char *want = getenv("RESIDENT_SHIM_TOUCH");
    return want != NULL && strcmp(want, mode) == 0;
}
static void touch(void *addr, size_t len) {
    for (size_t off = 0; off < len; off += 4096) ((volatile char *)addr)[off] = 1;
}
int madvise(void *addr, size_t len, int advice) {
    int rc = (int)syscall(SYS_madvise, addr, len, advice);
    if (rc == 0 && advice == MADV_HUGEPAGE && touching("thp")) touch(addr, len);
    return rc;
}
void *mmap(void *addr, size_t len, int prot, int flags, int fd, off_t off) {
    void *p = (void *)syscall(SYS_mmap, addr, len, prot, flags, fd, off);
    if (p != MAP_FAILED && (flags & MAP_ANONYMOUS) && (prot & PROT_WRITE) && len >= (16 << 20)
        && touching("mmap")) touch(p, len);
    return p;
}
void *mmap64(void *, size_t, int, int, int, off_t) __attribute__((alias("mmap")));
"""


def _resident_shim() -> str | None:
    """Path of the compiled ``_RESIDENT_SHIM`` (built once per machine); None without a working C compiler."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    tag = hashlib.sha256(_RESIDENT_SHIM.encode()).hexdigest()[:12]
    path = os.path.join(tempfile.gettempdir(), f"pdserve-perftest-resident-{tag}.so")
    if not os.path.exists(path):
        with tempfile.TemporaryDirectory() as tmp:
            src = os.path.join(tmp, "shim.c")
            with open(src, "w") as f:
                f.write(_RESIDENT_SHIM)
            built = subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", f"{path}.{os.getpid()}", src],
                                   capture_output=True)
        if built.returncode != 0:
            return None
        os.replace(f"{path}.{os.getpid()}", path)
    return path


def perftest_exe() -> str:
    """The ``ucx_perftest`` of the libucx wheel (which ucxx depends on); FileNotFoundError, naming
    the package, without it."""
    try:
        import libucx
    except ModuleNotFoundError:
        raise FileNotFoundError("ucx_perftest not found: install it (pip install libucx-cu12)") from None
    exe = os.path.join(os.path.dirname(libucx.__file__), "bin", "ucx_perftest")
    if not os.access(exe, os.X_OK):
        raise FileNotFoundError(f"ucx_perftest not found at {exe}: install it (pip install libucx-cu12)")
    return exe


def perftest_gbps(msg_bytes: int, total_bytes: int, device: str, thp: bool = True,
                  resident: bool = False) -> float:
    """``ucx_perftest -t tag_bw`` between two local processes; GB/s (1e9 bytes). Host
    buffers in transparent huge pages (``thp``) or 4 KiB pages, as our caches are;
    ``resident``: written once when allocated (``_RESIDENT_SHIM``), as our caches are."""
    exe = perftest_exe()
    root = os.path.dirname(os.path.dirname(exe))
    env = {**os.environ, "LD_LIBRARY_PATH": os.path.join(root, "lib"), "UCX_WARN_UNUSED_ENV_VARS": "n"}
    if device == "cpu":  # host memory only: with it, perftest cannot allocate CUDA memory
        env["UCX_ALLOC_PRIO"] = "thp,mmap,heap" if thp else "mmap,heap"
    if resident:
        shim = _resident_shim()
        if shim is None:
            raise RuntimeError("no C compiler for the resident-memory perftest shim")
        env.update(LD_PRELOAD=shim, RESIDENT_SHIM_TOUCH="thp" if thp else "mmap")
    port, iters = str(_free_port()), max(20, total_bytes * 4 // msg_bytes)
    mem = ["-m", "cuda"] if device == "cuda" else []
    server_env, client_env = env, env
    if device == "cuda":  # each process sees only its own GPU, as our sender and receiver use theirs
        server_env, client_env = ({**env, "CUDA_VISIBLE_DEVICES": gpu} for gpu in _two_gpus())
    server = subprocess.Popen([exe, "-p", port, *mem], env=server_env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = [exe, "127.0.0.1", "-p", port, "-t", "tag_bw", "-s", str(msg_bytes), "-n", str(iters), "-w", "10", "-f", *mem]
    try:
        out = _perftest_client(client, client_env, server)
    finally:
        server.wait(timeout=30)
    rows = [line.split() for line in out.splitlines() if re.match(r"^(Final:)?\s*\d+\s+\d", line)]
    if not rows:
        raise RuntimeError(f"ucx_perftest printed no result:\n{out}")
    mib_per_s = float(rows[-1][-3])  # overall bandwidth; perftest's MB is 2**20 bytes
    return mib_per_s * 2**20 / 1e9


def _perftest_client(cmd: list[str], env: dict[str, str], server: subprocess.Popen, wait_s: float = 30.0) -> str:
    """The client's output, retried while the server is not listening yet: a fixed one-second
    wait lost that race on a loaded 2-core machine ("connect() failed: Connection refused", a
    fresh-clone CI run). A refused client leaves the server waiting for the next."""
    deadline = time.monotonic() + wait_s
    while True:
        time.sleep(0.25)
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300).stdout
        refused = "connect() failed" in out or "Connection refused" in out
        if not refused or server.poll() is not None or time.monotonic() > deadline:
            return out


@functools.cache
def _two_gpus() -> tuple[str, str]:
    """The receiver's and the sender's GPU as ``CUDA_VISIBLE_DEVICES`` entries (cuda:1, cuda:0).

    perftest with both processes seeing both GPUs (the server told ``1,0``) reported
    1.2-2.0 TB/s for cuda:0 -> cuda:1 on 2x H200, several times what NVLink carries; with
    one GPU visible to each it reports 220-370 GB/s (16 to 512 MiB messages), under the
    ~390 GB/s copy ceiling (BENCHMARKS.md)."""
    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    ids = visible or [str(i) for i in range(_gpu_count())]
    return ids[1 % len(ids)], ids[0]


def _gpu_count() -> int:
    """GPUs on the machine, without starting CUDA in this process (``--isolate`` narrows what
    this process sees afterwards, which CUDA reads once, when it starts)."""
    listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout
    return max(1, sum(line.startswith("GPU ") for line in listed.splitlines()))


def memcpy_gbps(nbytes: int) -> float:
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def _d2d_main(conn: Connection) -> None:
    while (nbytes := conn.recv()) is not None:
        conn.send(d2d_gbps(nbytes))


class _D2D:
    """``d2d_gbps`` in a process of its own that sees both GPUs (``cudaMemcpyPeer``'s rate),
    started before this process narrows what it sees (``--isolate``)."""

    def __init__(self) -> None:
        self.conn, child = mp.get_context("spawn").Pipe()
        self.proc = mp.get_context("spawn").Process(target=_d2d_main, args=(child,), daemon=True)
        self.proc.start()

    def __call__(self, nbytes: int) -> float:
        self.conn.send(nbytes)
        return float(self.conn.recv())

    def close(self) -> None:
        self.conn.send(None)
        self.proc.join(30)


def d2d_gbps(nbytes: int) -> float:
    """torch copy cuda:0 -> cuda:1 (the device-to-device ceiling)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    dst = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{min(1, torch.cuda.device_count() - 1)}")
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize("cuda:0")
    torch.cuda.synchronize(dst.device)
    t0 = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    torch.cuda.synchronize("cuda:0")
    torch.cuda.synchronize(dst.device)
    return nbytes * 10 / (time.perf_counter() - t0) / 1e9


def run(args: argparse.Namespace) -> int:
    nbytes = args.layers * args.planes * args.blocks * args.block_bytes
    msg_bytes = args.blocks * args.block_bytes
    d2d = _D2D() if args.device == "cuda" else None
    if d2d is not None:
        _two_gpus()  # both GPUs' ids, read before --isolate narrows this process's view
    result: dict[str, Any] = {"backend": args.backend, "device": args.device, "bytes": nbytes,
                              "layers": args.layers, "planes": args.planes, "blocks": args.blocks,
                              "isolate": args.isolate,
                              "block_bytes": args.block_bytes, "thp": args.thp and args.device == "cpu",
                              "iters": args.iters, "inflight": args.inflight}
    if args.backend == "ucx":
        perftest_exe()  # the floor's tool is there before anything runs
        mem = " -m cuda" if args.device == "cuda" else ""
        alloc = "" if args.device == "cuda" else f"UCX_ALLOC_PRIO={'thp,mmap,heap' if args.thp else 'mmap,heap'} "
        result["raw"] = f"{alloc}ucx_perftest -t tag_bw -s {msg_bytes}{mem}"
        result["raw_transfer"] = f"{alloc}ucx_perftest -t tag_bw -s {nbytes}{mem}"
        resident = args.device == "cpu" and _resident_shim() is not None
        if args.device == "cpu" and not resident:
            print("cc not found: the resident-memory perftest floor is left out (apt-get install gcc)",
                  file=sys.stderr)
        if resident:
            result["raw_resident"] = f"{result['raw_transfer']}, buffers written once (LD_PRELOAD shim)"

        def raw() -> dict[str, float]:
            thp = args.thp and args.device == "cpu"
            figures = {"raw_gbps": perftest_gbps(msg_bytes, nbytes, args.device, thp),
                       "raw_transfer_gbps": perftest_gbps(nbytes, nbytes, args.device, thp)}
            if resident:
                figures["raw_resident_gbps"] = perftest_gbps(nbytes, nbytes, args.device, thp, resident=True)
            return figures
    elif d2d is not None:
        result["raw"] = f"torch copy cuda:0 -> cuda:1 of {nbytes} bytes (cudaMemcpyPeer)"

        def raw() -> dict[str, float]:
            return {"raw_gbps": d2d(nbytes)}
    else:
        result["raw"] = f"memcpy {nbytes} bytes"

        def raw() -> dict[str, float]:
            return {"raw_gbps": memcpy_gbps(nbytes)}
    result.update(_transfer_figures(args, raw))
    for r in result["rounds"]:
        r["gbps"] = nbytes / r["seconds"] / 1e9
        r["ratio"] = r["gbps"] / r["raw_gbps"]
        if "raw_transfer_gbps" in r:
            r["ratio_transfer"] = r["gbps"] / r["raw_transfer_gbps"]
        if "raw_resident_gbps" in r:
            r["ratio_resident"] = r["gbps"] / r["raw_resident_gbps"]
    for key in ("seconds", "gbps", "raw_gbps", "ratio", "raw_transfer_gbps", "ratio_transfer",
                "raw_resident_gbps", "ratio_resident"):
        if key in result["rounds"][0]:
            result[key] = statistics.median(r[key] for r in result["rounds"])
    if d2d is not None:
        result["d2d_gbps"] = d2d(nbytes)
        result["d2d_ratio"] = result["gbps"] / result["d2d_gbps"]
        d2d.close()
    result["verify_every"] = args.verify_every
    _print(result, args.json)
    return 0 if result["intact"] else 1


def _print(result: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(result))
        return
    print(f"{result['backend']} on {result['device']}: {result['bytes'] / 2**20:.1f} MiB in "
          f"{result['seconds'] * 1e3:.2f} ms = {result['gbps']:.2f} GB/s (median of {len(result['rounds'])} "
          f"rounds), "
          f"{result['messages']} data messages, intact={result['intact']}")
    print(f"raw ({result['raw']}): {result['raw_gbps']:.2f} GB/s; ratio {result['ratio']:.2f}")
    if "raw_transfer_gbps" in result:
        print(f"raw, one message of the whole transfer ({result['raw_transfer']}): "
              f"{result['raw_transfer_gbps']:.2f} GB/s; ratio {result['ratio_transfer']:.2f}")
    if "raw_resident_gbps" in result:
        print(f"raw, the same with resident buffers ({result['raw_resident']}): "
              f"{result['raw_resident_gbps']:.2f} GB/s; ratio {result['ratio_resident']:.2f}")
    for i, r in enumerate(result["rounds"]):
        extra = f", {r['raw_transfer_gbps']:.2f} ({r['ratio_transfer']:.2f})" if "ratio_transfer" in r else ""
        extra += f", {r['raw_resident_gbps']:.2f} ({r['ratio_resident']:.2f})" if "ratio_resident" in r else ""
        print(f"  round {i}: {r['gbps']:.2f} GB/s vs {r['raw_gbps']:.2f} ({r['ratio']:.2f}){extra}")
    if "d2d_gbps" in result:
        print(f"d2d ceiling (torch copy cuda:0 -> cuda:1): {result['d2d_gbps']:.2f} GB/s; "
              f"ratio {result['d2d_ratio']:.2f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve bench kv", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
