"""Serving benchmark: load a running router (gRPC or OpenAI HTTP) and report latency percentiles.

Receives a target (`--router HOST:PORT` for gRPC, `--base-url http://HOST:PORT` for the OpenAI
HTTP door, or `--launch` to start a local service with the `pdserve up` flags), a workload
(prompts from the built-in set, random token ids of `--input-len`, or a JSONL file; lengths from
`--input-len`/`--output-len`, fixed, uniform within `--range-ratio`, or a long tail with
`--length-dist lognormal`) and arrivals (Poisson at each `--request-rate`, `inf` = all at once,
optionally capped by `--max-concurrency`). Hands back, per rate: TTFT, TPOT, inter-token latency
(ITL) and end-to-end p50/p90/p99, output tokens/s, requests/s, SLO attainment and goodput under
`--slo-ttft-ms` / `--slo-tpot-ms`, as JSON (`--json FILE`, or stdout) and PNG plots
(`--plot-dir`). Requests ignore EOS so each writes exactly its output length.

Layouts compared (DistServe's goodput): `--launch --layout prefill=1,decode=1 --layout colocated=2`
starts each layout in turn and sweeps the same requests (one seed) at the same rates over each;
the report names the layouts, their GPUs, model, lengths and SLOs, and gives per layout its
goodput (bench/serve_goodput.py: the highest rate whose attainment reaches `--goodput-attainment`),
then the best disaggregated layout's goodput over the best colocated one's; a table is printed
and `--plot-dir` gets attainment.png (every layout's attainment against rate).

At saturation one client process is the limit before the service is: `--client-processes N`
spreads the load over N processes (bench/serve_clients.py). Each run also reports, in `cpu`, the
CPU seconds of the router's process (with `--launch`, or `--router-pid`), of every node process
(`--launch`) and of the client processes over the run: each one's share of a core and its
microseconds per output token and per chunk (an SSE event, or a gRPC stream message); with
`--py-spy-dir` each service process is sampled by py-spy over each run too (bench/py_spy.py).

Definitions: ITL samples are per token (a message of n tokens after a gap g counts g/n n
times, as the router's /metrics does); a request is "good" when its TTFT and its mean ITL
(TPOT) are within the SLOs; a run's `goodput` = good requests / wall time (vLLM's), its
`slo_attainment` = good requests / requests sent (DistServe's); a rate "holds the p99 SLO"
when its p99 TTFT and p99 ITL are both within them, and `max_rate_p99_slo_met` is the highest
rate below which every rate of the sweep holds it. With `--launch` the service's own /metrics
is read around each run (bench/serve_metrics.py): where the router's TTFT, the prefill and the
KV transfers (mean, p50, p99 per transfer) went.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
from pathlib import Path
from typing import Any

import settings
from bench.extras import require
from bench.serve_clients import measured_load
from bench.serve_goodput import (
    Layout,
    attainment,
    attains,
    comparison,
    goodput,
    goodput_grid,
    parse_layout,
    plot_attainment,
    table,
    tpot,
)
from bench.serve_load import Item, Result
from bench.serve_metrics import breakdown, scrape, settle

LOGNORMAL_SIGMA = 1.0  # --length-dist lognormal: a chat-like long tail (most short, a few many times the mean)
LONG_TAIL_CAP = 4  # ... cut at this many times the mean, so a prompt stays within a usual max_model_len
BUILTIN_PROMPTS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Explain in one sentence what a GPU is.",
    "List three primary colors.", "Summarize the plot of Romeo and Juliet.", "How do airplanes stay in the air?",
    "Give me a recipe for pancakes.", "Translate 'good morning' into Spanish.", "What is 17 times 23?",
    "Describe a cat to someone who has never seen one.", "Why is the sky blue?", "Name five programming languages.",
    "Write a short poem about autumn leaves.", "What does a compiler do?", "Tell me a fun fact about octopuses.",
    "How many continents are there?",
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    from deploy.cli_service import add_service_arguments

    t = p.add_argument_group("target (one of)")
    t.add_argument("--router", default=None, metavar="HOST:PORT", help="a router's gRPC address")
    t.add_argument("--base-url", default=None, help="a router's HTTP address (OpenAI API), e.g. http://127.0.0.1:8000")
    t.add_argument("--launch", action="store_true", help="start a local service (the `pdserve up` flags below)")
    p.add_argument("--layout", action="append", default=None, metavar="SPEC",
                   help="with --launch, repeatable: a layout to start and sweep in turn, e.g. prefill=1,decode=1 "
                   "or colocated=2 (keys: prefill, decode, colocated, tp, name, and dotted config keys of that "
                   "layout only, e.g. colocated.max_num_batched_tokens=256)")
    p.add_argument("--protocol", choices=("grpc", "http"), default="grpc", help="with --launch: which door to load")
    p.add_argument("--http-client", choices=("openai", "raw"), default="openai",
                   help="HTTP requests by the official `openai` client, or raw (httpx + json, as vLLM's "
                   "benchmark_serving): the openai client's request building (~10 us per prompt token id) "
                   "counts in its TTFT")
    p.add_argument("--tls-ca", default=None, metavar="PEM", help="speak TLS to the router, trusting this CA file "
                   "('system': the system's roots; with --launch --tls-cert: default the certificate itself)")
    p.add_argument("--dataset", default="builtin", help="'builtin' (chat prompts), 'random' (token ids) or a JSONL "
                   "file of {\"prompt\": ..., \"output_len\": N}")
    p.add_argument("--num-prompts", type=int, default=50, help="requests per rate (at least)")
    p.add_argument("--duration-s", type=float, default=0.0, metavar="S",
                   help="each finite rate sends for at least S seconds (rate x S requests when that is more than "
                   "--num-prompts), so a high rate reaches a steady state rather than a burst; the same "
                   "seeded requests, the first N of them at each rate")
    p.add_argument("--input-len", type=int, default=128, help="random dataset: prompt tokens")
    p.add_argument("--output-len", type=int, default=64, help="output tokens (JSONL entries may set their own)")
    p.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in len*(1 -+ ratio)")
    p.add_argument("--length-dist", choices=("uniform", "lognormal"), default="uniform",
                   help="uniform (within --range-ratio; 0: fixed lengths) or lognormal: a long tail of mean "
                   f"--input-len/--output-len (sigma {LOGNORMAL_SIGMA}, at most {LONG_TAIL_CAP}x the mean)")
    p.add_argument("--request-rate", default="inf", help="requests/s, comma-separated for a sweep; inf = all at once")
    p.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
    p.add_argument("--client-processes", type=int, default=1, metavar="N",
                   help="send from N processes (one client process saturates before a fast service does)")
    p.add_argument("--py-spy-dir", default=None, metavar="DIR",
                   help="sample every service process (--launch, or --router-pid) with py-spy over each rate's "
                        "run: collapsed stacks, every thread, DIR/rate<R>_<process>.txt")
    p.add_argument("--router-pid", type=int, default=None, metavar="PID",
                   help="report this process's CPU time per run as the router's (--launch: found itself)")
    p.add_argument("--slo-ttft-ms", type=float, default=1000.0, help="time to first token SLO")
    p.add_argument("--slo-tpot-ms", "--slo-itl-ms", dest="slo_tpot_ms", type=float, default=100.0,
                   help="time per output token SLO: a request's mean inter-token latency (--slo-itl-ms: the same)")
    p.add_argument("--slo-tpot-grid-ms", default=None, metavar="MS,MS",
                   help="also attainment and goodput at each of these TPOT SLOs (same TTFT SLO), from the same "
                   "sweep: a grid of SLOs for one run's cost")
    p.add_argument("--goodput-attainment", type=float, default=0.9, metavar="F",
                   help="goodput: the highest rate at which this share of requests meets both SLOs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, metavar="FILE", help="write the report here (default: stdout)")
    p.add_argument("--plot-dir", default=None, help="write latency_cdf.png and rate_sweep.png here")
    add_service_arguments(p)


def run(args: argparse.Namespace) -> int:
    rates = parse_rates(args.request_rate)
    check_args(args)
    items = load_dataset(argparse.Namespace(**{**vars(args), "num_prompts": max(
        prompts_at(args, r) for r in rates)}))
    if args.layout:
        report = run_layouts(args, items, rates)
    else:
        report = run_target(args, items, rates)
    text = json.dumps(report, indent=2)
    if args.json:
        Path(args.json).write_text(text + "\n")
    else:
        print(text)
    if args.layout:
        print(table(report), file=sys.stdout if args.json else sys.stderr, flush=True)
    if args.plot_dir:
        if args.layout:
            Path(args.plot_dir).mkdir(parents=True, exist_ok=True)
            plot_attainment(report, Path(args.plot_dir) / "attainment.png")
        else:
            plot(report, Path(args.plot_dir))
    return 0


def check_args(args: argparse.Namespace) -> None:
    if sum(bool(x) for x in (args.router, args.base_url, args.launch)) != 1:
        raise ValueError("give exactly one of --router, --base-url and --launch")
    if args.num_prompts <= 0 or args.output_len <= 0 or not 0 <= args.range_ratio < 1:
        raise ValueError("--num-prompts and --output-len must be > 0, --range-ratio in [0, 1)")
    if not 1 <= args.client_processes <= args.num_prompts:
        raise ValueError("--client-processes must be in 1..--num-prompts")
    if not 0 <= getattr(args, "duration_s", 0.0) <= 3600:
        raise ValueError("--duration-s must be in [0, 3600]")
    if not 0 < args.goodput_attainment <= 1:
        raise ValueError("--goodput-attainment must be in (0, 1]")
    if args.layout and not args.launch:
        raise ValueError("--layout starts services: give it with --launch")
    given = [f for f in ("prefill", "decode", "colocated", "prefill_tp", "decode_tp") if getattr(args, f, None)]
    if args.layout and given:
        raise ValueError(f"--layout sets the nodes of each layout; leave out --{given[0].replace('_', '-')}")


def run_target(args: argparse.Namespace, items: list[Item], rates: list[float]) -> dict:
    """One target's sweep (started here with --launch, with the `pdserve up` flags)."""
    service = None
    args.service_pids = {"router": args.router_pid} if args.router_pid else {}
    if args.launch:
        service, _ = launch(args)
    try:
        report = asyncio.run(sweep(args, items, rates))
        if getattr(args, "startup", None):
            report["startup"] = args.startup
    finally:
        if service is not None:
            from deploy.cli_service import shutdown

            shutdown(service)
    return report


def launch(args: argparse.Namespace) -> tuple[Any, Any]:
    """Start a local service from `args`' `pdserve up` flags and point `args` at it; (service, config)."""
    from deploy.cli_service import client_ca, scheme, service_config, start_service, startup_line

    cfg = service_config(args, local=True)
    service, args.router = start_service(cfg)
    args.startup = startup_line(service)
    print(args.startup, file=sys.stderr, flush=True)
    args.tls_ca = client_ca(args, cfg)
    args.service_pids = service_pids(service)
    args.metrics_url = f"{scheme(cfg)}://{service.http_address}" if service.http_address else None
    args.status_interval_s = cfg.router.status_interval_s  # how fresh the router's view of the nodes is
    args.kv_timeout_s = cfg.kv_transfer.timeout_s  # a failed transfer's blocks come back this long after (settle)
    if args.protocol == "http":
        args.base_url, args.router = args.metrics_url, None
    return service, cfg


def run_layouts(args: argparse.Namespace, items: list[Item], rates: list[float]) -> dict:
    """Every `--layout` started in turn and swept over the same `items` and `rates`. Each starts a
    local Ray cluster and stops it after, unless Ray was running before (then it is left running)."""
    import ray

    from deploy.service import gpus_needed

    layouts = [parse_layout(t) for t in args.layout]
    if len({lay.name for lay in layouts}) < len(layouts):
        raise ValueError("two --layout entries have the same name (give name=...)")
    out, model, ours = [], None, not ray.is_initialized()
    for lay in layouts:
        largs = layout_args(args, lay)
        service, cfg = launch(largs)
        try:
            report = asyncio.run(sweep(largs, items, rates))
        finally:
            service.stop()
            if ours:
                ray.shutdown()
        model = cfg.model.resolved_name()
        out.append({"name": lay.name, "disaggregated": lay.disaggregated, "nodes": cfg.node_counts,
                    "tp": cfg.decode.tp if lay.disaggregated else 1, "overrides": list(lay.overrides),
                    "gpus": gpus_needed(cfg), "startup": largs.startup, **report["goodput"],
                    "goodput_by_tpot_ms": report["goodput_by_tpot_ms"],
                    "max_rate_p99_slo_met": report["max_rate_p99_slo_met"], "runs": report["runs"]})
    if len({lay["gpus"] for lay in out}) > 1:
        print("warning: the layouts take different GPU counts: "
              + ", ".join(f"{lay['name']} {lay['gpus']:g}" for lay in out), file=sys.stderr)
    return {"model": model, **workload(args, items), "slo_ttft_ms": args.slo_ttft_ms,
            "slo_tpot_ms": args.slo_tpot_ms, "goodput_attainment": args.goodput_attainment,
            "request_rates": rates, "layouts": out, **comparison(out)}


def layout_args(args: argparse.Namespace, lay: Layout) -> argparse.Namespace:
    """`args` with the nodes (and config overrides) of `lay`."""
    largs = argparse.Namespace(**vars(args))
    for flag in ("prefill", "decode", "colocated", "prefill_tp", "decode_tp"):
        setattr(largs, flag, lay.flags.get(flag))
    largs.set = [*(args.set or []), *lay.overrides]
    largs.router = largs.base_url = None
    return largs


def workload(args: argparse.Namespace, items: list[Item]) -> dict:
    """What the requests were: the dataset, lengths (asked and drawn) and seed."""
    ins = [len(i.prompt) for i in items if isinstance(i.prompt, list)]
    outs = [i.output_len for i in items]
    return {"dataset": args.dataset, "num_prompts": len(items), "seed": args.seed, "input_len": args.input_len,
            "output_len": args.output_len, "range_ratio": args.range_ratio, "length_dist": args.length_dist,
            "input_len_mean": round(sum(ins) / len(ins), 1) if ins else None, "input_len_max": max(ins, default=None),
            "output_len_mean": round(sum(outs) / len(outs), 1), "output_len_max": max(outs),
            "max_concurrency": args.max_concurrency, "client_processes": args.client_processes,
            "rate_duration_s": getattr(args, "duration_s", 0.0)}


def service_pids(service: Any) -> dict[str, int]:
    """The router's and every node's process id (a TP node: rank 0's) of a launched service."""
    import ray

    pids = {"router" if i == 0 else f"router{i}": int(ray.get(h.status.remote(), timeout=30)["pid"])
            for i, h in enumerate(service.routers)}
    for (role, i), info in service.node_info().items():
        pids[f"{role}{i}"] = int(info["pid"])
    return pids


def prompts_at(args: argparse.Namespace, rate: float) -> int:
    """Requests sent at `rate`: --num-prompts, or more to fill --duration-s at a finite rate."""
    if math.isinf(rate):
        return args.num_prompts
    return max(args.num_prompts, math.ceil(rate * getattr(args, "duration_s", 0.0)))


def parse_rates(text: str) -> list[float]:
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--request-rate must be numbers or inf, got {text!r}") from None
    if not rates or any(not r > 0 for r in rates):
        raise ValueError(f"--request-rate must be > 0, got {text!r}")
    return rates


def load_dataset(args: argparse.Namespace) -> list[Item]:
    rng = random.Random(args.seed)

    def length(n: int) -> int:
        if getattr(args, "length_dist", "uniform") == "lognormal":  # mean n: mu = ln(n) - sigma^2 / 2
            x = rng.lognormvariate(math.log(n) - LOGNORMAL_SIGMA ** 2 / 2, LOGNORMAL_SIGMA)
            return max(1, min(round(x), LONG_TAIL_CAP * n))
        return max(1, rng.randint(round(n * (1 - args.range_ratio)), round(n * (1 + args.range_ratio))))

    if args.dataset == "builtin":
        return [Item(rng.choice(BUILTIN_PROMPTS), length(args.output_len)) for _ in range(args.num_prompts)]
    if args.dataset == "random":
        return [Item([rng.randrange(10, 250) for _ in range(length(args.input_len))], length(args.output_len))
                for _ in range(args.num_prompts)]
    rows = [json.loads(line) for line in Path(args.dataset).read_text().splitlines() if line.strip()]
    if not rows or not all(isinstance(r, dict) and isinstance(r.get("prompt"), str | list) for r in rows):
        raise ValueError(f"{args.dataset}: every line must be a JSON object with a 'prompt'")
    return [Item(r["prompt"], int(r.get("output_len") or length(args.output_len)))
            for r in (rows[i % len(rows)] for i in range(args.num_prompts))]


# ---- load -------------------------------------------------------------------------------------
async def sweep(args: argparse.Namespace, items: list[Item], rates: list[float]) -> dict:
    from tqdm import tqdm

    runs = []
    total = sum(min(len(items), prompts_at(args, r)) for r in rates)
    with tqdm(total=total, desc="bench serve", unit="req", disable=None) as bar:
        for rate in rates:
            bar.set_postfix(rate=rate)
            batch = items[:prompts_at(args, rate)]
            key = getattr(args, "api_key", None) or settings.API_KEY
            url = getattr(args, "metrics_url", None) or args.base_url
            before = await asyncio.to_thread(scrape, url, key)
            results, wall, cpu = await measured_load(args, batch, rate, bar)
            run = {**summarize(results, rate, wall, args), "cpu": cpu}
            interval = getattr(args, "status_interval_s", 1.0)
            settled, after = await asyncio.to_thread(settle, url, before, key, interval,
                                                     getattr(args, "kv_timeout_s", 0.0))
            run["server"] = {**breakdown(before, after, run["completed"]), **settled}
            runs.append(run)
    held = []  # rates, lowest first, up to the first that misses the p99 SLO
    for r in sorted(runs, key=lambda r: r["request_rate"]):
        if not r["p99_slo_met"]:
            break
        held.append(r["request_rate"])
    good = goodput([(r["request_rate"], r["slo_attainment"]) for r in runs], args.goodput_attainment)
    return {"target": args.base_url or args.router, "protocol": "http" if args.base_url else "grpc",
            **workload(args, items), "slo_ttft_ms": args.slo_ttft_ms, "slo_tpot_ms": args.slo_tpot_ms,
            "goodput_attainment": args.goodput_attainment, "goodput": good.as_dict(),
            "goodput_by_tpot_ms": goodput_grid(runs, args.goodput_attainment),
            "max_rate_p99_slo_met": max(held) if held else None, "runs": runs}


# ---- report -----------------------------------------------------------------------------------
def percentiles(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {"p50_ms": math.nan, "p90_ms": math.nan, "p99_ms": math.nan, "mean_ms": math.nan}
    s = sorted(xs)

    def q(p: float) -> float:
        return round(1000 * s[min(len(s) - 1, max(0, math.ceil(p * len(s)) - 1))], 2)

    return {"p50_ms": q(0.5), "p90_ms": q(0.9), "p99_ms": q(0.99), "mean_ms": round(1000 * sum(s) / len(s), 2)}


def tpot_grid(args: argparse.Namespace) -> list[float]:
    """The extra TPOT SLOs (ms) of `--slo-tpot-grid-ms`."""
    text = getattr(args, "slo_tpot_grid_ms", None)
    return [float(t) for t in text.split(",") if t.strip()] if text else []


def summarize(results: list[Result], rate: float, wall: float, args: argparse.Namespace) -> dict:
    ok = [r for r in results if r.ok]
    itl = [x for r in ok for x in r.itl]
    slo_ttft, slo_tpot = args.slo_ttft_ms / 1000, args.slo_tpot_ms / 1000
    good = sum(attains(r, slo_ttft, slo_tpot) for r in results)
    ttft, itl_p, e2e = percentiles([r.ttft for r in ok]), percentiles(itl), percentiles([r.e2e for r in ok])
    tpots = percentiles([t for r in ok if (t := tpot(r)) is not None])
    return {
        "request_rate": rate, "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5], "duration_s": round(wall, 3),
        "request_throughput": round(len(ok) / wall, 3),
        "output_throughput": round(sum(r.tokens for r in ok) / wall, 2),
        "goodput": round(good / wall, 3), "slo_attainment": round(attainment(results, slo_ttft, slo_tpot), 4),
        "attainment_by_tpot_ms": {f"{t:g}": round(attainment(results, slo_ttft, t / 1000), 4) for t in tpot_grid(args)},
        "ttft": ttft, "tpot": tpots, "itl": itl_p, "e2e": e2e,
        "p99_slo_met": bool(ok) and len(ok) == len(results) and ttft["p99_ms"] <= args.slo_ttft_ms
        and itl_p["p99_ms"] <= args.slo_tpot_ms,
        "samples": {"ttft_ms": [round(1000 * r.ttft, 2) for r in ok], "itl_ms": [round(1000 * x, 2) for x in itl],
                    "e2e_ms": [round(1000 * r.e2e, 2) for r in ok]},
    }


def plot(report: dict, out: Path) -> None:
    matplotlib = require("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    runs = report["runs"]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.4))
    for ax, key, title in zip(axes, ("ttft_ms", "itl_ms", "e2e_ms"), ("TTFT", "ITL", "end-to-end"), strict=True):
        for r in runs:
            xs = sorted(r["samples"][key])
            ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=f"{r['request_rate']:g} req/s")
        ax.set(title=f"{title} CDF", xlabel="ms", ylabel="fraction")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "latency_cdf.png", dpi=80)
    _plot_sweep(plt, report, out)


def _plot_sweep(plt: Any, report: dict, out: Path) -> None:
    runs = [r for r in report["runs"] if math.isfinite(r["request_rate"])]
    if not runs:
        return
    rates = [r["request_rate"] for r in runs]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.4))
    a.plot(rates, [r["ttft"]["p99_ms"] for r in runs], "o-", label="p99 TTFT")
    a.plot(rates, [r["itl"]["p99_ms"] for r in runs], "s-", label="p99 ITL")
    a.axhline(report["slo_ttft_ms"], ls="--", c="C0", lw=0.8)
    a.axhline(report["slo_tpot_ms"], ls="--", c="C1", lw=0.8)
    a.set(title="p99 latency vs rate (dashed: SLO)", xlabel="request rate (req/s)", ylabel="ms", yscale="log")
    a.legend(fontsize=7)
    b.plot(rates, [r["goodput"] for r in runs], "o-", label="goodput")
    b.plot(rates, [r["request_throughput"] for r in runs], "s--", label="throughput")
    b.set(title="goodput vs rate", xlabel="request rate (req/s)", ylabel="req/s")
    b.legend(fontsize=7)
    for ax in (a, b):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "rate_sweep.png", dpi=80)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="pdserve bench serve")
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
