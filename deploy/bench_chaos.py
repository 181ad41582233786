"""Chaos benchmark: faults together under load on a local service, and what was lost.

Receives the `pdserve up` flags (model, node counts, k, `--set`) and a workload: `--requests`
greedy requests of mixed lengths (random prompt ids, `--min-prompt`..`--max-prompt` tokens;
`--min-output`..`--max-output` tokens, EOS ignored), sent `--concurrency` at a time (default
twice what the decode nodes can hold: overload). While they run, together and repeatedly:
node actor kills (decode and prefill in turn, every `--kill-every` s; Ray restarts them), Abort
storms (every `--abort-every` s, Abort for a `--abort-fraction` of the requests in flight),
client cancels (a `--cancel-fraction` of requests walk away at a random token), and KV transfer
faults (`--kv-faults P`: each KV message from a prefill node dropped, delayed, duplicated and,
over tcp, truncated with probability P each; kvtransfer/faults.py).

Hands back a table: requests sent / finished correctly (tokens equal the single-process engine's
greedy output; an aborted or cancelled one, a prefix of it) / ended with a clean error (exactly
one terminal error with a message) / lost (no terminal message) / duplicated (more than one
terminal) / wrong tokens (a token duplicated, missing or different) / leaked KV blocks (every
node's free blocks back to its total, waited for) / migrations / the router's resident memory
before and after (it is never killed here). Exit status 1 unless lost,
duplicated, wrong and leaked are all 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEFAULTS = {"prefill": 2, "decode": 2, "spec_tokens": 3}
# A killed node is back after its restart (seconds): new requests wait for one that long
# rather than failing at once while every node of a kind is down.
SERVICE_DEFAULTS = ["router.node_wait_s=60"]


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
class Outcome:
    tokens: list[int] = field(default_factory=list)
    terminals: list[tuple[str, str]] = field(default_factory=list)  # ("finished", reason) or (code, message)
    cancelled: bool = False
    timed_out: bool = False


def add_arguments(p: argparse.ArgumentParser) -> None:
    from deploy.cli_service import add_service_arguments

    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--concurrency", type=int, default=None, help="default: 2 x decode nodes x decode.max_num_seqs")
    p.add_argument("--min-prompt", type=int, default=4)
    p.add_argument("--max-prompt", type=int, default=96)
    p.add_argument("--min-output", type=int, default=4)
    p.add_argument("--max-output", type=int, default=48)
    p.add_argument("--kill-every", type=float, default=4.0, help="seconds between node actor kills (0: none)")
    p.add_argument("--abort-every", type=float, default=1.0, help="seconds between Abort storms (0: none)")
    p.add_argument("--abort-fraction", type=float, default=0.05, help="share of in-flight requests each storm aborts")
    p.add_argument("--cancel-fraction", type=float, default=0.1, help="share of requests whose client walks away")
    p.add_argument("--kv-faults", type=float, default=0.005,
                   help="probability that a KV message is dropped, and the same for delayed, duplicated and "
                   "(tcp) truncated (kv_transfer.faults; 0: none)")
    p.add_argument("--deadline-s", type=float, default=600.0, help="per request (the router's deadline too)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, metavar="FILE", help="write the report here too")
    add_service_arguments(p)


def run(args: argparse.Namespace) -> int:
    from deploy.cli_service import service_config, shutdown, start_service
    from engine.loader import load_model_info

    for key, value in DEFAULTS.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    args.set = SERVICE_DEFAULTS + kv_fault_overrides(args) + (args.set or [])  # the user's --set wins
    cfg = service_config(args, local=True)
    jobs = make_jobs(args, load_model_info(cfg.model.resolved_name()).config.vocab_size)
    reference = reference_tokens(cfg.model.resolved_name(), jobs)
    service, address = start_service(cfg)
    try:
        report = chaos(service, address, jobs, reference, args, 2 * cfg.decode.num_nodes * cfg.decode.max_num_seqs)
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


def reference_tokens(model: str, jobs: list[Job]) -> list[list[int]]:
    """Greedy output of the single-process engine (no MTP) for every job."""
    from engine.engine import EngineConfig, LLMEngine
    from engine.loader import load_model
    from engine.sampling_params import SamplingParams

    engine = LLMEngine(load_model(model), EngineConfig())
    params = [SamplingParams(max_tokens=j.max_tokens, ignore_eos=True) for j in jobs]
    return [r.output_ids for r in engine.generate([j.prompt for j in jobs], params)]


def chaos(service: Any, address: str, jobs: list[Job], reference: list[list[int]], args: argparse.Namespace,
          default_concurrency: int) -> dict[str, Any]:
    """Run `jobs` under the faults; the report (leaks waited for, the router's migrations)."""
    import ray

    before = ray.get(service.router.status.remote(), timeout=60)
    start = time.perf_counter()
    outcomes, faults = asyncio.run(drive(service, address, jobs, args, args.concurrency or default_concurrency))
    wall = time.perf_counter() - start
    leaked = blocks_leaked(service, timeout_s=120)
    status = ray.get(service.router.status.remote(), timeout=60)
    report = tally(jobs, reference, outcomes)
    report.update(leaked_blocks=leaked, migrations=status.get("migrations", 0), faults=faults,
                  wall_s=round(wall, 1), concurrency=args.concurrency or default_concurrency,
                  router_terminals=status.get("terminals", {}),
                  router_rss_mb={"before": before.get("rss_mb"), "after": status.get("rss_mb")})
    report["clean"] = not (report["lost"] or report["duplicated"] or report["wrong_tokens"] or report["finished_wrong"]
                           or report["error_without_message"] or leaked)
    return report


async def drive(service: Any, address: str, jobs: list[Job], args: argparse.Namespace,
                concurrency: int) -> tuple[list[Outcome], dict[str, int]]:
    from router.client import RouterClient

    gate, inflight, faults = asyncio.Semaphore(concurrency), set[str](), Counter[str]()
    async with RouterClient(address) as client:
        done = asyncio.Event()
        injector = asyncio.create_task(inject(service, client, inflight, args, done, faults))
        try:
            outcomes = await asyncio.gather(*(one(client, gate, inflight, j, args.deadline_s) for j in jobs))
        finally:
            done.set()
            await injector
    return list(outcomes), dict(faults)


async def one(client: Any, gate: asyncio.Semaphore, inflight: set[str], job: Job, deadline_s: float) -> Outcome:
    """One stream, read to its end (or until the client walks away as planned)."""
    import grpc

    from router.client import build_request

    out = Outcome()
    request = build_request(job.prompt, max_tokens=job.max_tokens, ignore_eos=True, request_id=job.request_id,
                            timeout_s=deadline_s)
    async with gate:
        inflight.add(job.request_id)
        call = client.stream(request, timeout=deadline_s + 30)
        try:
            await read_stream(call, job, out)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                out.timed_out = True
            else:
                out.terminals.append((e.code().name, e.details() or ""))  # refused before it started
        finally:
            call.cancel()
            inflight.discard(job.request_id)
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


async def inject(service: Any, client: Any, inflight: set[str], args: argparse.Namespace,
                 done: asyncio.Event, faults: Counter[str]) -> None:
    """Kill node actors in turn and send Abort storms until `done`."""
    rng = random.Random(args.seed + 1)
    victims = [(role, i) for i in range(max(service.cfg.prefill.num_nodes, service.cfg.decode.num_nodes))
               for role in ("decode", "prefill")
               if i < (service.cfg.decode.num_nodes if role == "decode" else service.cfg.prefill.num_nodes)]
    loop = asyncio.get_running_loop()
    next_kill, next_abort, turn = loop.time() + args.kill_every, loop.time() + args.abort_every, 0
    while not done.is_set():
        now = loop.time()
        if args.kill_every > 0 and now >= next_kill:
            role, index = victims[turn % len(victims)]
            await asyncio.to_thread(service.kill, role, index)
            faults[f"killed_{role}"] += 1
            turn, next_kill = turn + 1, now + args.kill_every
        if args.abort_every > 0 and now >= next_abort and inflight:
            chosen = rng.sample(sorted(inflight), max(1, int(len(inflight) * args.abort_fraction)))
            found = await asyncio.gather(*(client.abort(rid) for rid in chosen), return_exceptions=True)
            faults["abort_rpcs"] += len(chosen)
            faults["aborted_found"] += sum(f is True for f in found)
            next_abort = now + args.abort_every
        try:
            await asyncio.wait_for(done.wait(), 0.1)
        except TimeoutError:
            pass


def tally(jobs: list[Job], reference: list[list[int]], outcomes: list[Outcome]) -> dict[str, Any]:
    """Sort every request into the report's rows."""
    rows: Counter[str] = Counter(sent=len(jobs))
    errors: Counter[str] = Counter()
    examples: dict[str, str] = {}
    for job, ref, out in zip(jobs, reference, outcomes, strict=True):
        rows[classify(job, ref, out)] += 1
        if len(out.terminals) > 1:
            rows["duplicated"] += 1
        if out.tokens != ref[: len(out.tokens)] or (not out.cancelled and len(out.tokens) > job.max_tokens):
            rows["wrong_tokens"] += 1
        if out.terminals and out.terminals[0][0] != "finished":
            errors[out.terminals[0][0]] += 1
            examples.setdefault(out.terminals[0][0], out.terminals[0][1][:300])
    keys = ("sent", "finished_correct", "aborted_correct", "cancelled_by_client", "clean_error", "lost",
            "duplicated", "wrong_tokens", "finished_wrong", "error_without_message")
    return {**{k: rows[k] for k in keys}, "errors_by_code": dict(errors), "error_examples": examples}


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
        try:
            info = service.node_info()
        except Exception:  # a node still restarting: ask again
            info = None
        if info is not None:
            leaked = sum(i["total_blocks"] - i["free_blocks"] for i in info.values())
            if leaked == 0 or time.monotonic() > deadline:
                return int(leaked)
        elif time.monotonic() > deadline:
            return -1
        time.sleep(0.5)
