"""Local TP groups: one process per rank on this host, over torch.distributed.

`spawn_ranks(size, fn, args, device)` starts `size` processes (spawn start method); rank r
joins a group on 127.0.0.1 (gloo on the CPU; NCCL on CUDA, rank r on cuda:r), runs
`fn(tp, *args)` and sends back what it returned (it must pickle: plain host values). The
caller gets the values in rank order. A rank that fails ends the group: its error is raised
(a user error as itself, ValueError and the like; anything else as a RuntimeError with the
rank's traceback) and the other ranks (which may wait in a collective) are stopped.

`check_tp_model(model, tp, setting)` is the check before any rank starts: a TP size the
model's heads or vocabulary do not split over is one clear error, from its config alone.

Rank-0 output rule: every rank runs the same steps on the same inputs and samples the same
tokens; by convention `fn` returns (and prints) what the user sees on rank 0 only.
"""

from __future__ import annotations

import os
import socket
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine.model.loader import load_model_info
from engine.model.paths import default_model
from engine.tp.tensor_parallel import TPGroup, check_tp_size

COLLECTIVE_TIMEOUT_S = 120


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_device(device: str, rank: int) -> str:
    """The device of `rank`: cuda:rank on CUDA, else `device` itself."""
    return f"cuda:{rank}" if device.startswith("cuda") else device


def check_tp_model(model: str | None, tp: int, setting: str, load_format: str = "auto") -> None:
    """Before any rank starts: a TP size (given as `setting`) that the model's heads or vocabulary
    do not split over is a clear error (engine/tp/tensor_parallel.py `plan`), from its config alone."""
    name = model or default_model()
    config = load_model_info(name, load_format).config
    try:
        check_tp_size(config, tp)
    except ValueError as e:
        raise ValueError(f"{setting} {tp} does not fit model {name!r}: {e}") from None


def init_group(rank: int, size: int, port: int, device: str, store_outside: bool = False) -> TPGroup:
    """Join the local group of `size` ranks rendezvousing at 127.0.0.1:port: a store rank 0
    serves, or with `store_outside` one the launching process serves (`spawn_ranks`)."""
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))  # the ranks share the cores
    timeout = timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    where: dict[str, Any] = (
        {"store": dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)} if store_outside
        else {"init_method": f"tcp://127.0.0.1:{port}"})
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=size, timeout=timeout, **where)
    return TPGroup(rank, size)


USER_ERRORS = (ValueError, FileNotFoundError, ModuleNotFoundError)  # raised again as such in the caller


def _rank_main(rank: int, size: int, port: int, device: str, fn: Callable[..., Any], args: tuple,
               queue: Any) -> None:
    try:
        tp = init_group(rank, size, port, device, store_outside=True)
        queue.put((rank, True, fn(tp, *args)))
    except BaseException as e:
        user = (type(e).__name__, str(e)) if isinstance(e, USER_ERRORS) else None
        queue.put((rank, False, (traceback.format_exc(), user)))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn_ranks(size: int, fn: Callable[..., Any], args: tuple = (), device: str = "cpu",
                timeout: float = 600.0) -> list[Any]:
    """fn(tp, *args) on `size` local ranks; their return values in rank order."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    # the group's store lives here, not in rank 0: a rank 0 that ends first would leave the
    # others' NCCL watchdogs polling a closed store (a warning with a C++ trace at every exit)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    port = store.port
    procs = [ctx.Process(target=_rank_main, args=(r, size, port, device, fn, args, queue), daemon=True)
             for r in range(size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        while len(results) < size:
            rank, ok, value = queue.get(timeout=timeout)
            if not ok:
                raise _failure(queue, {rank: value})
            results[rank] = value
    finally:
        _stop(procs, wait=len(results) == size)
        queue.close()
        queue.join_thread()
        del store  # after every rank has ended
    return [results[r] for r in range(size)]


def _failure(queue: Any, failed: dict[int, tuple], grace_s: float = 1.0) -> Exception:
    """The error to raise: a rank's user error (ValueError, ...) as itself, else a RuntimeError
    with every failing rank's traceback. Ranks that fail within `grace_s` count too (a rank left
    waiting in a collective fails after the one that caused it)."""
    try:
        while True:
            rank, ok, value = queue.get(timeout=grace_s)
            if not ok:
                failed[rank] = value
    except Exception:  # queue.Empty: no more news
        pass
    for rank, (_, user) in sorted(failed.items()):
        if user is not None:
            cls = next(c for c in USER_ERRORS if c.__name__ == user[0])
            return cls(f"rank {rank}: {user[1]}")
    return RuntimeError("\n".join(f"tensor-parallel rank {r} failed:\n{tb}" for r, (tb, _) in sorted(failed.items())))


def _stop(procs: list[Any], wait: bool) -> None:
    """Join the ranks (they are ending) or, after a failure, stop those still running."""
    for p in procs:
        p.join(timeout=30 if wait else 0)
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join()
