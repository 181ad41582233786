"""`pdserve bench pd`: disaggregated serving (a prefill node and a decode node) against a
colocated node, with the same requests at the same arrival times, in one run.

By default every node runs in its own process behind its gRPC server, and requests go through
the router (bench/pd_procs.py): the prefill node on `--prefill-device` and the decode node on
`--decode-device` (KV over `--kv-backend`, tcp or ucx), then a colocated node
(decode_node/colocated.py: chunks of `--max-num-batched-tokens` prompt tokens between decode
steps) on `--colocated-device`. `--in-process` runs the older mode: both nodes as plain objects
in this process (any backend, `local` by default), then an `LLMEngine` for the colocated side.
A background batch of `--background` long requests keeps the decode batch running, so every
arrival (Poisson, `--rate` per second) is inserted into a running batch. Reports, for both:
TTFT (submission to first token) and inter-token latency per token (an output item's gap
over its token count) at p50/p90/p99, the disaggregated TTFT's stages (queue, prefill compute,
KV tail after it, first-token hand-off, the first decode step after the insert), the background requests' inter-token latency before
and during the arrivals (the step time with and without continuous inserts), and with
`--plot FILE.png` the ITL distributions of both. Greedy, random prompts, `ignore_eos`.
"""

from __future__ import annotations

import argparse
import json
import random
import threading
import time
from collections.abc import Callable

import torch

from bench.engine import add_model_arguments, load
from bench.extras import require
from bench.pd_schedule import WARMUP_ITEMS, Trace, greedy_params, node_config, workload
from engine.engine import LLMEngine, resolve_request
from engine.model.loader import LoadedModel


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.add_argument("--spec-tokens", type=int, default=0)
    p.add_argument("--prefill-device", default="cpu")
    p.add_argument("--decode-device", default="cpu")
    p.add_argument("--colocated-device", default=None, help="default: the decode device")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--kv-backend", default=None, choices=["local", "tcp", "ucx"],
                   help="default: tcp (local needs --in-process)")
    p.add_argument("--in-process", action="store_true",
                   help="the nodes as plain objects in this process, an LLMEngine as the colocated side")
    p.add_argument("--max-num-batched-tokens", type=int, default=512,
                   help="prompt tokens per prefill step (prefill node; colocated: per chunk between decode steps)")
    p.add_argument("--rate", type=float, default=2.0, help="arrivals per second (Poisson)")
    p.add_argument("--num-requests", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--background", type=int, default=4, help="long requests decoding throughout")
    p.add_argument("--background-tokens", type=int, default=512, help="their output length (aborted at the end)")
    p.add_argument("--kv-cache-bytes", type=int, default=1 << 30, help="KV cache per engine")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", default=None, help="write the ITL distributions as this PNG")


# ---------------------------------------------------------------- disaggregated


class PDRun:
    """A prefill node and a decode node wired directly (the router's part done here)."""

    def __init__(self, args: argparse.Namespace, loaded_p: LoadedModel, loaded_d: LoadedModel) -> None:
        from decode_node.node import DecodeNode
        from prefill_node.node import PrefillNode

        self.decode = DecodeNode(loaded_d, node_config(args, args.decode_device), kv_backend=args.kv_backend,
                                 kv_timeout_s=30)
        self.prefill = PrefillNode(loaded_p, node_config(args, args.prefill_device),
                                   lambda addr, msg: self.decode.first_token(msg), kv_backend=args.kv_backend,
                                   kv_timeout_s=30)
        self.prefill.timings, self.decode.timings = {}, {}  # per-request events, for the breakdown
        self.loaded, self.lock = loaded_d, threading.Condition()
        self.traces: dict[str, Trace] = {}
        self._sub = self.decode.subscribe()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.decode.start()
        self.prefill.start()

    def _read(self) -> None:
        while (batch := self._sub.get()) is not None:
            now = time.monotonic()
            with self.lock:
                for item in batch:
                    tr = self.traces.get(item.request_id)
                    if tr is None:
                        continue
                    if item.tokens:
                        tr.items.append((now, len(item.tokens)))
                        tr.tokens += item.tokens
                    tr.ended = tr.ended or bool(item.finish_reason or item.error)
                self.lock.notify_all()

    def submit(self, rid: str, prompt: list[int], max_tokens: int) -> None:
        from prefill_node.node import PrefillJob

        params = greedy_params(max_tokens)
        req = resolve_request(rid, prompt, params, (), self.decode.max_model_len, random.Random(0),
                              self.loaded.model.config.vocab_size)
        tr = Trace(submitted=time.monotonic())
        with self.lock:
            self.traces[rid] = tr
        res = self.decode.reserve(rid, len(prompt), params, req.seed, req.stop_ids).result(timeout=60)
        if not res.admitted:
            raise RuntimeError(f"decode node refused {rid}: {res.reason}")
        fut = self.prefill.submit(PrefillJob(rid, prompt, params, req.seed, req.stop_ids, res.descriptor, "d"))
        fut.add_done_callback(lambda f: self._first(tr, f))

    def _first(self, tr: Trace, fut) -> None:
        now = time.monotonic()
        with self.lock:
            tr.first = now
            tr.tokens.insert(0, fut.result().token)
            self.lock.notify_all()

    def wait(self, cond, timeout: float = 600.0) -> None:
        with self.lock:
            if not self.lock.wait_for(cond, timeout):
                raise TimeoutError("requests did not finish in time")

    def abort(self, rid: str) -> None:
        self.decode.abort(rid)

    def close(self) -> None:
        self.prefill.stop()
        self.decode.stop()


def breakdown(pd: PDRun, n: int) -> dict[str, float]:
    return stages_of(n, pd.traces, lambda rid: (pd.prefill.timings or {}).get(rid, {}),
                     lambda rid: (pd.decode.timings or {}).get(rid, {}))


def stages_of(n: int, traces: dict[str, Trace], prefill_events: Callable[[str], dict[str, float]],
              decode_events: Callable[[str], dict[str, float]]) -> dict[str, float]:
    """Median ms of each stage of the arrivals' first token: queued on P, prefill compute (to
    the first token's read point), the KV still arriving after it (as D's loop sees it), the
    first-token message's hand-off P -> D, and D's first decode step after the insert (to the
    first decode output seen by the bench: through the router, in the per-process mode)."""
    spans: dict[str, list[float]] = {}
    for i in range(n):
        rid = f"r{i}"
        p, d, tr = prefill_events(rid), decode_events(rid), traces[rid]
        stages = {"queue": (p.get("queued"), p.get("started")), "prefill_compute": (p.get("started"), p.get("computed")),
                  "kv_tail": (p.get("computed"), d.get("kv_done")), "handoff": (p.get("first_sent"), d.get("first_received")),
                  "first_decode_step": (d.get("inserted"), tr.items[0][0] if tr.items else None)}
        for name, (a, b) in stages.items():
            if a is not None and b is not None:
                spans.setdefault(name, []).append(max(0.0, b - a))
    return {name: round(1000 * pct(xs, 50), 3) for name, xs in spans.items()}


def run_pd(args, loaded_p, loaded_d, times, prompts, background) -> tuple[dict[str, Trace], dict[str, float]]:
    pd = PDRun(args, loaded_p, loaded_d)
    try:
        for i, p in enumerate(background):
            pd.submit(f"bg{i}", p, args.background_tokens)
        pd.wait(lambda: all(len(pd.traces[f"bg{i}"].items) >= WARMUP_ITEMS for i in range(len(background))))
        start = time.monotonic()
        for i, (t, p) in enumerate(zip(times, prompts, strict=True)):
            time.sleep(max(0.0, start + t - time.monotonic()))
            pd.submit(f"r{i}", p, args.output_len)
        pd.wait(lambda: all(pd.traces[f"r{i}"].ended for i in range(len(prompts))))
        for i in range(len(background)):
            pd.abort(f"bg{i}")
        pd.wait(lambda: all(tr.ended for tr in pd.traces.values()))
        pd.traces["_start"] = Trace(submitted=start)
        return pd.traces, breakdown(pd, len(prompts))
    finally:
        pd.close()


# ---------------------------------------------------------------- colocated


def run_colocated(args, loaded, times, prompts, background) -> dict[str, Trace]:
    eng = LLMEngine(loaded, node_config(args, args.colocated_device or args.decode_device))
    traces: dict[str, Trace] = {}
    for i, p in enumerate(background):
        eng.add_request(p, greedy_params(args.background_tokens), f"bg{i}")
        traces[f"bg{i}"] = Trace(submitted=time.monotonic())
    while any(len(traces[f"bg{i}"].items) < WARMUP_ITEMS for i in range(len(background))):
        _record(eng.step(), traces)
    start, pending = time.monotonic(), list(enumerate(zip(times, prompts, strict=True)))
    while pending or any(not traces[f"r{i}"].ended for i in range(len(prompts)) if f"r{i}" in traces):
        while pending and start + pending[0][1][0] <= time.monotonic():
            i, (t, p) = pending.pop(0)
            eng.add_request(p, greedy_params(args.output_len), f"r{i}")
            traces[f"r{i}"] = Trace(submitted=start + t)
        if eng.has_unfinished():
            _record(eng.step(), traces)
        else:
            time.sleep(0.0005)
    for i in range(len(background)):
        eng.abort(f"bg{i}")
    while eng.has_unfinished():
        eng.step()
    traces["_start"] = Trace(submitted=start)
    return traces


def _record(outputs, traces: dict[str, Trace]) -> None:
    now = time.monotonic()
    for out in outputs:
        tr = traces[out.request_id]
        if tr.first is None:
            tr.first = now
            tr.items.append((now, 0))
            tr.tokens += out.new_token_ids[:1]
            rest = out.new_token_ids[1:]
        else:
            rest = out.new_token_ids
        if rest:
            tr.items.append((now, len(rest)))
            tr.tokens += rest
        tr.ended = tr.ended or out.finish_reason is not None


# ---------------------------------------------------------------- figures


def itl(trace: Trace) -> list[float]:
    """Per-token inter-token latency (s): each output item's gap from the previous output
    (the first token included), spread over its tokens."""
    out, last = [], trace.first
    for t, n in trace.items:
        if n and last is not None:
            out += [(t - last) / n] * n
        last = t
    return out


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q / 100 * len(s)))]


def summary(traces: dict[str, Trace], n: int) -> dict:
    start = traces["_start"].submitted
    reqs = [traces[f"r{i}"] for i in range(n)]
    ttft = [tr.first - tr.submitted for tr in reqs if tr.first is not None]
    lat = [x for tr in reqs for x in itl(tr)]
    bg = [tr for name, tr in traces.items() if name.startswith("bg")]
    before = [x for tr in bg for x in itl(_window(tr, None, start))]
    during = [x for tr in bg for x in itl(_window(tr, start, None))]
    ms = lambda xs, q: round(1000 * pct(xs, q), 3)  # noqa: E731
    return {"ttft_ms": {f"p{q}": ms(ttft, q) for q in (50, 90, 99)},
            "itl_ms": {f"p{q}": ms(lat, q) for q in (50, 90, 99)},
            "background_itl_ms_before": ms(before, 50), "background_itl_ms_during": ms(during, 50),
            "insert_slowdown": round(pct(during, 50) / pct(before, 50), 3) if before and during else None,
            "itl_samples": lat}


def _window(tr: Trace, after: float | None, before: float | None) -> Trace:
    items = [(t, k) for t, k in tr.items if (after is None or t >= after) and (before is None or t < before)]
    return Trace(tr.submitted, items[0][0] if items else None, items[1:])


def plot(path: str, pd: list[float], colo: list[float]) -> None:
    matplotlib = require("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, xs in (("disaggregated", pd), ("colocated", colo)):
        s = sorted(1000 * x for x in xs)
        ax.plot(s, [(i + 1) / len(s) for i in range(len(s))], label=name)
    ax.set_xscale("log")
    ax.set_xlabel("inter-token latency (ms)")
    ax.set_ylabel("fraction of tokens")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def run(args: argparse.Namespace) -> int:
    if args.kv_backend is None:
        args.kv_backend = "local" if args.in_process else "tcp"
    if args.kv_backend == "local" and not args.in_process:
        raise SystemExit("error: --kv-backend local moves KV inside one process: use tcp or ucx, or --in-process")
    if args.max_num_batched_tokens <= 0:
        raise SystemExit("error: --max-num-batched-tokens must be > 0")
    colo_dev = args.colocated_device or args.decode_device
    if args.in_process:
        with torch.no_grad():
            loaded_p, loaded_d = load(args, args.prefill_device), load(args, args.decode_device)
            name, vocab = loaded_d.name, loaded_d.model.config.vocab_size
            times, prompts, background = workload(args, vocab)
            pd_traces, stages = run_pd(args, loaded_p, loaded_d, times, prompts, background)
            colo_traces = run_colocated(args, loaded_d if colo_dev == args.decode_device else load(args, colo_dev),
                                        times, prompts, background)
    else:
        from bench import pd_procs

        info = pd_procs.model_info(args)
        name = info.name
        times, prompts, background = workload(args, info.config.vocab_size)
        pd_traces, p_events, d_events = pd_procs.run_pd(args, times, prompts, background)
        stages = stages_of(len(prompts), pd_traces, lambda rid: p_events.get(rid, {}),
                           lambda rid: d_events.get(rid, {}))
        colo_traces = pd_procs.run_colocated(args, times, prompts, background)
    pd, colo = summary(pd_traces, len(prompts)), summary(colo_traces, len(prompts))
    pd["ttft_breakdown_ms_p50"] = stages
    same = all(pd_traces[f"r{i}"].tokens == colo_traces[f"r{i}"].tokens for i in range(len(prompts)))
    if args.plot:
        plot(args.plot, pd["itl_samples"], colo["itl_samples"])
    for s in (pd, colo):
        s.pop("itl_samples")
    print(json.dumps({"model": name, "spec_tokens": args.spec_tokens, "rate": args.rate,
                      "mode": "in-process" if args.in_process else "processes",
                      "max_num_batched_tokens": args.max_num_batched_tokens,
                      "requests": len(prompts), "background": len(background), "kv_backend": args.kv_backend,
                      "devices": [args.prefill_device, args.decode_device, colo_dev],
                      "same_tokens": same, "disaggregated": pd, "colocated": colo}), flush=True)
    return 0
