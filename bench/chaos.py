"""Chaos benchmark: faults together under load on a local service, and what was lost.

Receives the `pdserve up` flags (model, node counts, k, `--set`) and a workload: `--requests`
greedy requests of mixed lengths (random prompt ids, `--min-prompt`..`--max-prompt` tokens;
`--min-output`..`--max-output` tokens, EOS ignored), sent `--concurrency` at a time (default
twice what the decode nodes can hold: overload). While they run, together and repeatedly:
node actor kills (decode and prefill in turn, every `--kill-every` s; Ray restarts them; every
`--step-error-every`-th of them instead a CUDA error in the node's next step, which ends its
process the way a real device fault does), Abort
storms (every `--abort-every` s, Abort for a `--abort-fraction` of the requests in flight),
client cancels (a `--cancel-fraction` of requests walk away at a random token), and KV transfer
faults (`--kv-faults P`: each KV message from a prefill node dropped, delayed, duplicated and,
over tcp, truncated with probability P each; kvtransfer/faults.py), and router restarts (the
router actor killed `--router-restart-every` s after it last came back, one kill at a time; Ray
restarts it and the service's watcher makes it serve again at the same address with its nodes:
deploy/service.py).

The client, as a client that retries would, waits for the router (gRPC wait_for_ready) before a
request starts; a stream open when the router dies breaks, and that broken stream (UNAVAILABLE) is
the request's one terminal error: a clean error, never lost. A transport error after the terminal
message is not a second terminal. Every call has a deadline (`--deadline-s` + 30 s), so nothing
hangs: a request past it counts as lost.

Hands back a table: requests sent / finished correctly (tokens equal the single-process engine's
greedy output; an aborted or cancelled one, a prefix of it) / ended with a clean error (exactly
one terminal error with a message) / lost (no terminal message) / duplicated (more than one
terminal) / wrong tokens (a token duplicated, missing or different) / leaked KV blocks (every
node's free blocks back to its total, waited for) / migrations (summed over router instances) /
router restarts / each process kind's resident memory (router, prefill, decode: the largest
before and after, the peak; a killed process's successor is a new process, counted as replaced,
so its figures start again). Exit status 1 unless lost, duplicated, wrong and leaked are all 0.

While it runs it says on stderr what it is doing (the reference tokens, the service's start) and,
every `--progress-s`, how many requests ended and how, how many are in flight and which faults
were injected, so a slow run can be told from a stuck one. Past `--timeout-s` for the whole run
it prints what is still in flight (each request's tokens so far) and where the load sits (the
router's counts, every node's running requests and KV), and exits 2.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import math
import random
import re
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEFAULTS = {"prefill": 2, "decode": 2, "spec_tokens": 3}
# A killed node is back after its restart (seconds): new requests wait for one that long
# rather than failing at once while every node of a kind is down.
SERVICE_DEFAULTS = ["router.node_wait_s=60"]
# A restarted router serves at the same address: look for it again soon (gRPC's default backoff
# grows to minutes).
RECONNECT_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 200), ("grpc.min_reconnect_backoff_ms", 200),
                     ("grpc.max_reconnect_backoff_ms", 1000)]


@dataclass
class Job:
    index: int
    prompt: list[int]
    max_tokens: int
    cancel_at: int | None  # the client walks away after this many tokens

    @property
    def request_id(self) -> str:
        return f"chaos-{self.index}"


@dataclass
class Injected:
    """What the injector did: fault counts, and each killed router instance's own counts (read
    just before its kill)."""

    faults: Counter[str] = field(default_factory=Counter)
    routers: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Outcome:
    tokens: list[int] = field(default_factory=list)
    terminals: list[tuple[str, str]] = field(default_factory=list)  # ("finished", reason) or (code, message)
    cancelled: bool = False
    timed_out: bool = False
    broke_after_terminal: bool = False  # the transport failed after the terminal message: not a 2nd terminal


def add_arguments(p: argparse.ArgumentParser) -> None:
    from deploy.cli_service import add_service_arguments

    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--concurrency", type=int, default=None, help="default: 2 x decode nodes x decode.max_num_seqs")
    p.add_argument("--min-prompt", type=int, default=4)
    p.add_argument("--max-prompt", type=int, default=96)
    p.add_argument("--min-output", type=int, default=4)
    p.add_argument("--max-output", type=int, default=48)
    p.add_argument("--kill-every", type=float, default=4.0, help="seconds between node actor kills (0: none)")
    p.add_argument("--router-restart-every", type=float, default=60.0,
                   help="seconds from the router's last restart to its next kill (Ray restarts it; 0: none)")
    p.add_argument("--max-kills", type=int, default=None, help="node actor kills at most (default: no limit)")
    p.add_argument("--step-error-every", type=int, default=0, metavar="N",
                   help="every Nth node fault is a CUDA error in the node's next step instead of a kill (0: none)")
    p.add_argument("--max-router-kills", type=int, default=None, help="router kills at most (default: no limit)")
    p.add_argument("--abort-every", type=float, default=1.0, help="seconds between Abort storms (0: none)")
    p.add_argument("--abort-fraction", type=float, default=0.05, help="share of in-flight requests each storm aborts")
    p.add_argument("--cancel-fraction", type=float, default=0.1, help="share of requests whose client walks away")
    p.add_argument("--kv-faults", type=float, default=0.005,
                   help="probability that a KV message is dropped, and the same for delayed, duplicated and "
                   "(tcp) truncated (kv_transfer.faults; 0: none)")
    p.add_argument("--deadline-s", type=float, default=600.0, help="per request (the router's deadline too)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--reference-cache", default=None, metavar="FILE",
                   help="keep the single-process reference output here and reuse it when the model and the "
                   "requests are the same (10,000 requests take minutes to half an hour on a small CPU)")
    p.add_argument("--json", default=None, metavar="FILE", help="write the report here too")
    p.add_argument("--progress-s", type=float, default=5.0,
                   help="seconds between progress lines on stderr (0: none)")
    p.add_argument("--timeout-s", type=float, default=1800.0,
                   help="the whole run's deadline: past it, print what is still in flight and where, exit 2")
    add_service_arguments(p)


def run(args: argparse.Namespace) -> int:
    from deploy.cli_service import service_config, shutdown, start_service
    from engine.model.info import load_model_info

    for key, value in DEFAULTS.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    args.set = SERVICE_DEFAULTS + kv_fault_overrides(args) + (args.set or [])  # the user's --set wins
    cfg = service_config(args, local=True)
    jobs = make_jobs(args, load_model_info(cfg.model.resolved_name(), cfg.model.load_format).config.vocab_size)
    say(f"reference tokens of {len(jobs)} requests from the engine alone ({cfg.model.resolved_name()})")
    reference = cached_reference(args.reference_cache, cfg.model, jobs)
    say("starting the service")
    service, address = start_service(cfg)
    try:
        report = chaos(service, address, jobs, reference, args, 2 * cfg.decode.num_nodes * cfg.decode.max_num_seqs)
    except Stuck as stuck:
        print(json.dumps(stuck.report, indent=2))
        return 2
    finally:
        shutdown(service)
    report["service"] = {"model": cfg.model.resolved_name(), "prefill_nodes": cfg.prefill.num_nodes,
                         "decode_nodes": cfg.decode.num_nodes, "k": cfg.spec.num_speculative_tokens}
    text = json.dumps(report, indent=2)
    if args.json:
        Path(args.json).write_text(text + "\n")
    print(text)
    return 0 if report["clean"] else 1


def kv_fault_overrides(args: argparse.Namespace) -> list[str]:
    p = args.kv_faults
    kinds = ["drop", "delay", "duplicate"] + (["truncate"] if "kv_transfer.backend=tcp" in (args.set or []) else [])
    return [f"kv_transfer.faults.{k}={p}" for k in kinds] if p > 0 else []


def make_jobs(args: argparse.Namespace, vocab: int) -> list[Job]:
    rng = random.Random(args.seed)
    jobs = []
    for i in range(args.requests):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(args.min_prompt, args.max_prompt))]
        n = rng.randint(args.min_output, args.max_output)
        cancel = rng.randint(1, max(1, n - 1)) if rng.random() < args.cancel_fraction else None
        jobs.append(Job(i, prompt, n, cancel))
    return jobs


def cached_reference(path: str | None, model: Any, jobs: list[Job]) -> list[list[int]]:
    """`reference_tokens`, read from `path` when it holds this model's output for these very
    requests (a digest of model, device, dtype, mode, prompts and lengths), else computed (and
    written there)."""
    key = [model.resolved_name(), model.load_format, model.resolved_device(), model.dtype, model.deterministic]
    digest = hashlib.sha256(json.dumps([key, [[j.prompt, j.max_tokens] for j in jobs]]).encode()).hexdigest()
    if path and Path(path).exists():
        cached = json.loads(Path(path).read_text())
        if cached.get("digest") == digest:
            return [list(map(int, t)) for t in cached["tokens"]]
    tokens = reference_tokens(model, jobs)
    if path:
        Path(path).write_text(json.dumps({"digest": digest, "tokens": tokens}))
    return tokens


def reference_tokens(model: Any, jobs: list[Job]) -> list[list[int]]:
    """Greedy output of the single-process engine (no MTP) for every job, on the service's
    device, dtype and kernels (`model`: its config section). On a GPU the service runs with
    --deterministic, whose batch-invariant kernels make its greedy tokens independent of how
    requests are batched, so the service must equal this whatever it batched."""
    from engine.engine import EngineConfig, LLMEngine
    from engine.model.loader import load_model
    from engine.sampling.sampling_params import SamplingParams

    device = model.resolved_device()
    loaded = load_model(model.resolved_name(), device=device, dtype=model.dtype, load_format=model.load_format)
    engine = LLMEngine(loaded, EngineConfig(device=device, deterministic=model.deterministic))
    params = [SamplingParams(max_tokens=j.max_tokens, ignore_eos=True) for j in jobs]
    tokens = [r.output_ids for r in engine.generate([j.prompt for j in jobs], params)]
    del engine
    if device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()  # the service's actors get the memory back
    return tokens


def chaos(service: Any, address: str, jobs: list[Job], reference: list[list[int]], args: argparse.Namespace,
          default_concurrency: int) -> dict[str, Any]:
    """Run `jobs` under the faults; the report (leaks waited for, migrations, memory)."""
    import ray

    before, restarts_before = processes(service), service.router_restarts  # a service may run several
    start = time.perf_counter()
    concurrency = args.concurrency or default_concurrency
    say(f"{len(jobs)} requests, {concurrency} at a time")
    outcomes, injected = asyncio.run(drive(service, address, jobs, args, concurrency))
    wall = time.perf_counter() - start
    wait_router_back(service, restarts_before + injected.faults["killed_router"], timeout_s=180)
    leaked = blocks_leaked(service, timeout_s=120)
    routers = injected.routers + [instance_counts(ray.get(service.router.status.remote(), timeout=60))]
    report = tally(jobs, reference, outcomes)
    report.update(leaked_blocks=leaked, migrations=sum(r["migrations"] for r in routers),
                  router_restarts=service.router_restarts - restarts_before, faults=dict(injected.faults),
                  wall_s=round(wall, 1),
                  concurrency=args.concurrency or default_concurrency,
                  router_terminals=dict(sum((Counter(r["terminals"]) for r in routers), Counter())),
                  router_instances=routers, memory=memory_report(before, processes(service)))
    report["clean"] = not (report["lost"] or report["duplicated"] or report["wrong_tokens"] or report["finished_wrong"]
                           or report["error_without_message"] or leaked)
    return report


def instance_counts(status: dict[str, Any]) -> dict[str, Any]:
    """One router instance's own counts (a restarted one counts from 0)."""
    return {"terminals": status.get("terminals", {}), "migrations": status.get("migrations", 0)}


def wait_router_back(service: Any, kills: int, timeout_s: float) -> None:
    """Until the service's watcher has made the router serve again after each of `kills` (one
    kill at a time: the injector waits for the last restart before the next), counted over the
    service's life."""
    deadline = time.monotonic() + timeout_s
    while service.router_restarts < kills and time.monotonic() < deadline:
        time.sleep(0.2)


def processes(service: Any) -> dict[str, dict[str, Any]]:
    """Every process of the service by name (router, prefill-0, ...): pid, rss_mb, max_rss_mb."""
    import ray

    keys = ("pid", "rss_mb", "max_rss_mb")
    out = {"router": {k: v for k, v in ray.get(service.router.status.remote(), timeout=60).items() if k in keys}}
    info = node_info_when_up(service, timeout_s=120) or {}
    out.update({f"{role}-{i}": {k: node[k] for k in keys} for (role, i), node in info.items()})
    return out


def memory_report(before: dict[str, dict[str, Any]], after: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per kind: the largest resident memory (MiB) before and after, the largest peak, and how many
    processes were replaced (killed and restarted: a new process, its figures start again)."""
    out: dict[str, Any] = {}
    for kind in ("router", "prefill", "decode"):
        names = [n for n in after if n.split("-")[0] == kind]
        out[kind] = {"rss_mb_before": max((before[n]["rss_mb"] for n in names if n in before), default=None),
                     "rss_mb_after": max(after[n]["rss_mb"] for n in names),
                     "max_rss_mb_after": max(after[n]["max_rss_mb"] for n in names),
                     "processes": len(names),
                     "replaced": sum(n not in before or before[n]["pid"] != after[n]["pid"] for n in names)}
    out["note"] = ("rss_mb: resident memory now (VmRSS), max_rss_mb: its peak (VmHWM); a replaced process "
                   "was killed and restarted during the run, so its 'after' figures are a new process's")
    return out


async def drive(service: Any, address: str, jobs: list[Job], args: argparse.Namespace,
                concurrency: int) -> tuple[list[Outcome], Injected]:
    from router.client import RouterClient

    gate, inflight, injected = asyncio.Semaphore(concurrency), dict[str, Outcome](), Injected()
    ended: list[Outcome] = []
    async with RouterClient(address, options=RECONNECT_OPTIONS) as client:
        done = asyncio.Event()
        injector = asyncio.create_task(inject(service, client, inflight, args, done, injected))
        reporter = asyncio.create_task(report_progress(len(jobs), inflight, ended, injected, args, done))
        requests = asyncio.gather(*(one(client, gate, inflight, ended, j, args.deadline_s) for j in jobs))
        try:
            await asyncio.wait([requests], timeout=args.timeout_s or None)
            if not requests.done():  # the report first: cancelling empties `inflight`
                stuck = await asyncio.to_thread(stuck_report, service, jobs, inflight, ended, args)
                requests.cancel()
                await asyncio.gather(requests, return_exceptions=True)
                raise Stuck(stuck)
            outcomes = requests.result()
        finally:
            done.set()
            await injector
            await reporter
    return list(outcomes), injected


async def one(client: Any, gate: asyncio.Semaphore, inflight: dict[str, Outcome], ended: list[Outcome], job: Job,
              deadline_s: float) -> Outcome:
    """One stream, read to its end (or until the client walks away as planned). A stream that
    breaks before its terminal message (the router died) ends with that error as its terminal."""
    import grpc

    from router.client import build_request

    out = Outcome()
    request = build_request(job.prompt, max_tokens=job.max_tokens, ignore_eos=True, request_id=job.request_id,
                            timeout_s=deadline_s)
    async with gate:
        inflight[job.request_id] = out
        call = client.stream(request, timeout=deadline_s + 30, wait_for_ready=True)
        try:
            await read_stream(call, job, out)
        except grpc.aio.AioRpcError as e:
            if out.terminals:
                out.broke_after_terminal = True
            elif e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                out.timed_out = True
            else:  # refused, or the stream broke: its one terminal
                out.terminals.append((e.code().name, e.details() or f"the stream ended with {e.code().name}"))
        finally:
            call.cancel()
            inflight.pop(job.request_id, None)
            ended.append(out)
    return out


async def read_stream(call: Any, job: Job, out: Outcome) -> None:
    async for msg in call:
        out.tokens += msg.token_ids
        if msg.HasField("finished"):
            out.terminals.append(("finished", msg.finished.reason))
        elif msg.HasField("error"):
            out.terminals.append((msg.error.code, msg.error.message))
        if job.cancel_at is not None and len(out.tokens) >= job.cancel_at and not out.terminals:
            out.cancelled = True
            return


async def inject(service: Any, client: Any, inflight: dict[str, Outcome], args: argparse.Namespace,
                 done: asyncio.Event, injected: Injected) -> None:
    """Kill node actors in turn, kill the router (`router_restart_every` s after it last came
    back) and send Abort storms until `done`."""
    rng, faults = random.Random(args.seed + 1), injected.faults
    victims = [(role, i) for i in range(max(service.cfg.prefill.num_nodes, service.cfg.decode.num_nodes))
               for role in ("decode", "prefill")
               if i < (service.cfg.decode.num_nodes if role == "decode" else service.cfg.prefill.num_nodes)]
    loop = asyncio.get_running_loop()
    restart_every = getattr(args, "router_restart_every", 0.0)
    next_kill, next_abort, turn = loop.time() + args.kill_every, loop.time() + args.abort_every, 0
    next_restart: float | None = loop.time() + restart_every
    restarts_before = service.router_restarts  # the service's count, over its life
    max_kills, max_router_kills = getattr(args, "max_kills", None), getattr(args, "max_router_kills", None)
    while not done.is_set():
        now = loop.time()
        if max_kills is not None and turn >= max_kills:
            next_kill = math.inf
        if max_router_kills is not None and faults["killed_router"] >= max_router_kills:
            next_restart = math.inf
        if args.kill_every > 0 and now >= next_kill:
            await node_fault(service, *fault_for(turn, victims, getattr(args, "step_error_every", 0)), faults)
            turn, next_kill = turn + 1, now + args.kill_every
        if next_restart is None and service.router_restarts - restarts_before >= faults["killed_router"]:  # back
            next_restart = now + restart_every
        if restart_every > 0 and next_restart is not None and now >= next_restart:
            await kill_router(service, injected)
            next_restart = None
        if args.abort_every > 0 and now >= next_abort and inflight:
            await abort_storm(client, rng, inflight, args.abort_fraction, faults)
            next_abort = now + args.abort_every
        try:
            await asyncio.wait_for(done.wait(), 0.1)
        except TimeoutError:
            pass


def fault_for(turn: int, victims: list[tuple[str, int]], error_every: int) -> tuple[str, tuple[str, int]]:
    """The `turn`-th node fault: ("error", victim) every `error_every`-th turn (a CUDA error in the
    node's next step), else ("kill", victim). Kills and errors each go round the victims on their own
    count, so every node meets both whatever `error_every` and the number of nodes are."""
    if error_every > 0 and (turn + 1) % error_every == 0:
        return "error", victims[((turn + 1) // error_every - 1) % len(victims)]
    kills = turn - (turn + 1) // error_every if error_every > 0 else turn
    return "kill", victims[kills % len(victims)]


async def node_fault(service: Any, kind: str, victim: tuple[str, int], faults: Counter[str]) -> None:
    """A node fault (`fault_for`): a process kill, or a step error."""
    role, index = victim
    if kind == "error":
        await asyncio.to_thread(service.fail_step, role, index)
        faults[f"step_error_{role}"] += 1
    else:
        await asyncio.to_thread(service.kill, role, index)
        faults[f"killed_{role}"] += 1


async def kill_router(service: Any, injected: Injected) -> None:
    """Kill the router actor (Ray restarts it), first keeping the counts it made (marked unread
    when it did not answer in time: then they are missing from the report's sums)."""
    import ray

    try:
        status: dict[str, Any] = await asyncio.to_thread(ray.get, service.router.status.remote(), timeout=60)
        injected.routers.append(instance_counts(status))
    except Exception as e:
        injected.routers.append({"terminals": {}, "migrations": 0, "unread": repr(e)[:200]})
    await asyncio.to_thread(service.kill_router)
    injected.faults["killed_router"] += 1


async def abort_storm(client: Any, rng: random.Random, inflight: dict[str, Outcome], fraction: float,
                      faults: Counter[str]) -> None:
    chosen = rng.sample(sorted(inflight), max(1, int(len(inflight) * fraction)))
    found = await asyncio.gather(*(client.abort(rid) for rid in chosen), return_exceptions=True)
    faults["abort_rpcs"] += len(chosen)
    faults["aborted_found"] += sum(f is True for f in found)


class Stuck(Exception):
    """The run passed `--timeout-s`; `report` says what was still in flight and where."""

    def __init__(self, report: dict[str, Any]) -> None:
        super().__init__("chaos run timed out")
        self.report = report


def say(text: str) -> None:
    print(f"chaos [{time.strftime('%H:%M:%S')}]: {text}", file=sys.stderr, flush=True)


async def report_progress(total: int, inflight: dict[str, Outcome], ended: list[Outcome], injected: Injected,
                          args: argparse.Namespace, done: asyncio.Event) -> None:
    """A line every `--progress-s` until `done`: requests ended (how), in flight, faults injected."""
    start = time.monotonic()
    while args.progress_s > 0 and not done.is_set():
        try:
            await asyncio.wait_for(done.wait(), args.progress_s)
        except TimeoutError:
            say(progress_line(total, inflight, ended, injected.faults, time.monotonic() - start))


def progress_line(total: int, inflight: dict[str, Outcome], ended: list[Outcome], faults: Counter[str],
                  elapsed: float) -> str:
    kinds = Counter("cancelled" if o.cancelled else "lost" if not o.terminals else
                    "finished" if o.terminals[0][0] == "finished" else "error" for o in ended)
    kills = {k.removeprefix("killed_"): n for k, n in faults.items() if k.startswith(("killed_", "step_error_"))}
    return (f"{len(ended)}/{total} ended ({', '.join(f'{n} {k}' for k, n in sorted(kinds.items())) or 'none'}), "
            f"{len(inflight)} in flight, {sum(len(o.tokens) for o in inflight.values())} of their tokens in; "
            f"kills {kills or 0}, aborts {faults['abort_rpcs']}; {elapsed:.0f} s")


def stuck_report(service: Any, jobs: list[Job], inflight: dict[str, Outcome], ended: list[Outcome],
                 args: argparse.Namespace) -> dict[str, Any]:
    """What a run past its deadline leaves: each request in flight (tokens in, of how many), and
    where the service's load sits (the router's counts and every node's queue and KV)."""
    wanted = {j.request_id: j.max_tokens for j in jobs}
    report: dict[str, Any] = {
        "timed_out": True, "timeout_s": args.timeout_s, "ended": len(ended), "sent": len(jobs),
        "in_flight": [{"request_id": rid, "tokens": len(o.tokens), "max_tokens": wanted.get(rid)}
                      for rid, o in sorted(inflight.items())],
        "waiting_for_a_slot": len(jobs) - len(ended) - len(inflight)}
    try:
        import ray

        report["router"] = {k: v for k, v in ray.get(service.router.status.remote(), timeout=30).items()
                            if k in ("queued_requests", "running_requests", "migrations", "terminals")}
        report["nodes"] = {f"{role}-{i}": {k: v for k, v in info.items()
                                           if k in ("running", "queued_tokens", "free_blocks", "total_blocks")}
                           for (role, i), info in service.node_info().items()}
    except Exception as e:  # the service itself may be what is stuck: say so, keep the rest
        report["service_unreachable"] = repr(e)[:300]
    say(f"timed out after {args.timeout_s:.0f} s: {len(inflight)} in flight, "
        f"{report['waiting_for_a_slot']} not started")
    return report


def tally(jobs: list[Job], reference: list[list[int]], outcomes: list[Outcome]) -> dict[str, Any]:
    """Sort every request into the report's rows."""
    rows: Counter[str] = Counter(sent=len(jobs))
    errors: Counter[str] = Counter()
    kinds: Counter[str] = Counter()
    examples: dict[str, str] = {}
    wrong: list[dict[str, Any]] = []
    for job, ref, out in zip(jobs, reference, outcomes, strict=True):
        rows[classify(job, ref, out)] += 1
        if len(out.terminals) > 1:
            rows["duplicated"] += 1
        if out.tokens != ref[: len(out.tokens)] or (not out.cancelled and len(out.tokens) > job.max_tokens):
            rows["wrong_tokens"] += 1
            if len(wrong) < 5:
                wrong.append(wrong_example(job, ref, out))
        if out.terminals and out.terminals[0][0] != "finished":
            errors[out.terminals[0][0]] += 1
            kinds[error_kind(out.terminals[0][1])] += 1
            examples.setdefault(out.terminals[0][0], out.terminals[0][1][:300])
    keys = ("sent", "finished_correct", "aborted_correct", "cancelled_by_client", "clean_error", "lost",
            "duplicated", "wrong_tokens", "finished_wrong", "error_without_message")
    return {**{k: rows[k] for k in keys}, "errors_by_code": dict(errors), "error_examples": examples,
            "errors_by_kind": dict(kinds.most_common(12)), "wrong_examples": wrong}


def wrong_example(job: Job, ref: list[int], out: Outcome) -> dict[str, Any]:
    """Where a request's tokens left the reference: its first differing index and the tokens
    around it (a shift by one there means a token duplicated or dropped, not a numeric change)."""
    at = next((i for i, (a, b) in enumerate(zip(out.tokens, ref, strict=False)) if a != b), min(len(out.tokens), len(ref)))
    return {"job": job.index, "prompt_len": len(job.prompt), "got_len": len(out.tokens), "ref_len": len(ref),
            "first_diff": at, "got": out.tokens[max(0, at - 3) : at + 4], "ref": ref[max(0, at - 3) : at + 4]}


def error_kind(message: str) -> str:
    """An error message without its addresses, ids and numbers (up to its first "("), to
    group errors by cause."""
    head = message.split("(", 1)[0]
    return re.sub(r"\d+(\.\d+)*(:\d+)?", "N", head).strip()[:120]


def classify(job: Job, ref: list[int], out: Outcome) -> str:
    if out.cancelled:
        return "cancelled_by_client"
    if not out.terminals or out.timed_out:
        return "lost"
    kind, detail = out.terminals[0]
    if kind == "finished":
        whole = detail == "length" and out.tokens == ref
        return "finished_correct" if whole else "aborted_correct" if detail == "abort" else "finished_wrong"
    return "clean_error" if detail else "error_without_message"


def blocks_leaked(service: Any, timeout_s: float) -> int:
    """KV blocks not back on their node once every lease and quarantine could have ended."""
    deadline = time.monotonic() + timeout_s
    while True:
        info = node_info_when_up(service, timeout_s=max(0.0, deadline - time.monotonic()))
        if info is None:
            return -1
        leaked = sum(i["total_blocks"] - i["free_blocks"] for i in info.values())
        if leaked == 0 or time.monotonic() > deadline:
            return int(leaked)
        time.sleep(0.5)


def node_info_when_up(service: Any, timeout_s: float) -> dict | None:
    """Every node's info, asking again while one is still restarting; None past `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return dict(service.node_info())
        except Exception:
            if time.monotonic() > deadline:
                return None
        time.sleep(0.5)
