"""Prefix-cache benchmark: a multi-turn chat on a local service, without and with the cache.

Receives the `pdserve up` flags (model, node counts, `--set`) and a workload: `--conversations`
chats run at once, each `--turns` turns; every prompt is a shared system prompt
(`--system-len` tokens), the conversation so far (earlier user turns and the model's answers)
and a new user turn (`--user-len` tokens, random ids); answers are `--output-len` tokens
(EOS ignored). The same workload runs twice in one process, each time on a fresh service on one
local Ray cluster: `baseline` (prefill.prefix_cache off, router.policy least_load) and `prefix`
(cache on, router.policy prefix; with `--decode-prefix-cache` the decode nodes cache too, so
only the blocks they lack cross the wire). Hands back, per run: TTFT p50/p90/p99 (client side,
over every turn), prompt tokens sent, prompt tokens the prefill nodes computed, KV bytes the
prefill nodes pushed (and did not, the decode node holding them), per-node hit rates; and the
ratios baseline / prefix. Both runs are greedy, so they must give the same tokens (`same_tokens`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from pathlib import Path
from typing import Any

ARMS = {"baseline": ["prefill.prefix_cache=false", "router.policy=least_load"],
        "prefix": ["prefill.prefix_cache=true", "router.policy=prefix"]}


def add_arguments(p: argparse.ArgumentParser) -> None:
    from deploy.cli_service import add_service_arguments

    p.add_argument("--conversations", type=int, default=8, help="chats at once")
    p.add_argument("--turns", type=int, default=6, help="turns per chat")
    p.add_argument("--system-len", type=int, default=256, help="shared system prompt (tokens)")
    p.add_argument("--user-len", type=int, default=48, help="tokens per user turn")
    p.add_argument("--output-len", type=int, default=16, help="tokens per answer")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--decode-prefix-cache", action="store_true",
                   help="the prefix run also turns on decode.prefix_cache: only missing KV blocks are sent")
    p.add_argument("--json", default=None, metavar="FILE", help="write the report here (default: stdout)")
    add_service_arguments(p)


def run(args: argparse.Namespace) -> int:
    if min(args.conversations, args.turns, args.system_len, args.user_len, args.output_len) <= 0:
        raise ValueError("--conversations, --turns, --system-len, --user-len and --output-len must be > 0")
    if args.enable_prefix_caching:
        raise ValueError("bench prefix runs with and without the cache itself; drop --enable-prefix-caching")
    report: dict[str, Any] = {"workload": {k: getattr(args, k) for k in
                                           ("conversations", "turns", "system_len", "user_len", "output_len")}}
    answers = {}
    try:
        for arm in ARMS:
            report[arm], answers[arm] = run_arm(args, arm)
    finally:
        import ray

        ray.shutdown()
    report["same_tokens"] = answers["baseline"] == answers["prefix"]
    report["ratios"] = ratios(report["baseline"], report["prefix"])
    text = json.dumps(report, indent=2)
    if args.json:
        Path(args.json).write_text(text + "\n")
    print(text)
    return 0


def run_arm(args: argparse.Namespace, arm: str) -> tuple[dict[str, Any], list[list[int]]]:
    """Start a fresh service for `arm`, warm it, run the chat, read the nodes' counters, stop it."""
    from deploy.cli_service import service_config, start_service
    from engine.model.info import load_model_info

    sets = ARMS[arm] + (["decode.prefix_cache=true"] if arm == "prefix" and args.decode_prefix_cache else [])
    cfg = service_config(argparse.Namespace(**{**vars(args), "set": (args.set or []) + sets}), local=True)
    vocab = load_model_info(cfg.model.resolved_name(), cfg.model.load_format).config.vocab_size
    service, address = start_service(cfg)
    try:
        asyncio.run(warm_up(address, cfg.prefill.num_nodes, vocab))
        before = prefill_counters(service)
        start = time.perf_counter()
        ttfts, answers, prompt_tokens = asyncio.run(chat(address, args, vocab))
        wall = time.perf_counter() - start
        after = prefill_counters(service)
    finally:
        service.stop()
    return summary(ttfts, prompt_tokens, before, after, wall), answers


async def warm_up(address: str, nodes: int, vocab: int) -> None:
    """One short request per prefill node (first-call costs), prompts shared with nothing else."""
    from router.client import RouterClient, build_request

    rng = random.Random(-1)
    async with RouterClient(address) as client:
        await asyncio.gather(*(client.generate(build_request([rng.randrange(vocab) for _ in range(40)],
                                                             max_tokens=2, ignore_eos=True))
                               for _ in range(2 * nodes)))


async def chat(address: str, args: argparse.Namespace, vocab: int) -> tuple[list[float], list[list[int]], int]:
    """Every conversation at once, each turn after the previous answer; TTFTs, answers, prompt tokens."""
    from router.client import RouterClient

    rng = random.Random(args.seed)
    draw = lambda n: [rng.randrange(vocab) for _ in range(n)]  # noqa: E731
    system = draw(args.system_len)
    users = [[draw(args.user_len) for _ in range(args.turns)] for _ in range(args.conversations)]
    ttfts: list[float] = []
    answers: list[list[int]] = [[] for _ in range(args.conversations * args.turns)]
    sent = [0]
    async with RouterClient(address) as client:
        async def conversation(c: int) -> None:
            history = list(system)
            for t in range(args.turns):
                history += users[c][t]
                sent[0] += len(history)
                ttft, tokens = await one_turn(client, history, args.output_len)
                ttfts.append(ttft)
                answers[c * args.turns + t] = tokens
                history += tokens

        await asyncio.gather(*(conversation(c) for c in range(args.conversations)))
    return ttfts, answers, sent[0]


async def one_turn(client: Any, prompt: list[int], output_len: int) -> tuple[float, list[int]]:
    from router.client import build_request

    start, ttft, tokens = time.perf_counter(), None, []
    async for msg in client.responses(build_request(prompt, max_tokens=output_len, ignore_eos=True)):
        if msg.HasField("error"):
            raise RuntimeError(f"request failed: {msg.error.code}: {msg.error.message}")
        if msg.token_ids and ttft is None:
            ttft = time.perf_counter() - start
        tokens += list(msg.token_ids)
    assert ttft is not None
    return ttft, tokens


def prefill_counters(service: Any) -> dict[str, dict[str, int]]:
    keys = ("prefill_tokens", "prefix_query_tokens", "prefix_hit_tokens", "prefix_requests", "prefix_hit_requests",
            "kv_bytes", "kv_skipped_bytes")
    return {f"prefill-{i}": {k: int(info.get(k, 0)) for k in keys}
            for (role, i), info in service.node_info().items() if role == "prefill"}


def summary(ttfts: list[float], prompt_tokens: int, before: dict, after: dict, wall: float) -> dict[str, Any]:
    from bench.serve import percentiles

    delta = {n: {k: after[n][k] - before[n][k] for k in after[n]} for n in after}
    nodes = {n: {"prefill_tokens": d["prefill_tokens"],
                 "hit_rate_tokens": round(d["prefix_hit_tokens"] / d["prefix_query_tokens"], 4) if d["prefix_query_tokens"] else 0.0,
                 "hit_rate_requests": round(d["prefix_hit_requests"] / d["prefix_requests"], 4) if d["prefix_requests"] else 0.0}
             for n, d in delta.items()}
    return {"requests": len(ttfts), "wall_s": round(wall, 2), "ttft": percentiles(ttfts),
            "prompt_tokens": prompt_tokens, "prefill_tokens_computed": sum(d["prefill_tokens"] for d in delta.values()),
            "kv_bytes_sent": sum(d["kv_bytes"] for d in delta.values()),
            "kv_bytes_not_sent": sum(d["kv_skipped_bytes"] for d in delta.values()), "nodes": nodes}


def ratios(base: dict[str, Any], cached: dict[str, Any]) -> dict[str, Any]:
    def cut(a: float, b: float) -> float:
        return round(a / b, 2) if b else float("inf")

    out = {"prefill_tokens_cut": cut(base["prefill_tokens_computed"], cached["prefill_tokens_computed"]),
           "ttft_p50_cut": cut(base["ttft"]["p50_ms"], cached["ttft"]["p50_ms"]),
           "ttft_p99_cut": cut(base["ttft"]["p99_ms"], cached["ttft"]["p99_ms"]),
           "kv_bytes_cut": cut(base["kv_bytes_sent"], cached["kv_bytes_sent"])}
    out["goal_prefill_tokens_3x"] = out["prefill_tokens_cut"] >= 3
    out["goal_ttft_p50_2x"] = out["ttft_p50_cut"] >= 2
    return out
