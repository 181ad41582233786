"""Prefix caching through the service on a local Ray cluster: 2 prefill nodes with the cache,
the prefix routing policy, a decode node with its own cache, a multi-turn chat; greedy output
equals the single-process engine without a cache, the caches hit, only the KV blocks the decode
node lacks cross the wire, hit rates reach /metrics, and every KV block comes back."""

from __future__ import annotations

import asyncio
import random
import time

import pytest
import torch

from engine.sampling.sampling_params import SamplingParams
from router.client import RouterClient, build_request
from tests.e2e.conftest import run_async, start_service, wait_blocks_returned
from tests.e2e.test_service import scrape, total

pytestmark = pytest.mark.usefixtures("ray_cluster")

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def service():
    svc, address = start_service(2, 1, 3, **{"prefill.prefix_cache": True, "router.policy": "prefix",
                                             "decode.prefix_cache": True})
    yield svc, address
    svc.stop()


def block_bytes(k: int) -> int:
    """One KV block of every layer (the MTP layer too when k > 0) of the tiny model, fp32."""
    from engine.cache.kv_cache import KVCache
    from engine.model.info import load_model_info

    arch = load_model_info("tiny").config
    return KVCache.bytes_per_block(arch.num_hidden_layers + (k > 0), 16, arch.num_key_value_heads, arch.head_dim,
                                   torch.float32)


async def chat(address, conversations: list[list[int]], turns: int, rng: random.Random):
    """Every conversation takes `turns` turns at once (sent in a new order each turn, so least
    load would move them between nodes); each turn appends the answer and a new user message.
    Returns every (prompt, answer), turn by turn, conversations in their own order."""
    history = [list(c) for c in conversations]
    asked: list[tuple[list[int], list[int]]] = []
    async with RouterClient(address) as client:
        for _ in range(turns):
            for h in history:
                h += [rng.randrange(256) for _ in range(rng.choice([6, 11, 20]))]
            order = rng.sample(range(len(history)), len(history))
            sent = await asyncio.gather(*(client.generate(build_request(history[i], max_tokens=MAX_TOKENS,
                                                                        ignore_eos=True)) for i in order))
            results = [sent[order.index(c)] for c in range(len(history))]
            for h, r in zip(history, results, strict=True):
                asked.append((list(h), r["token_ids"]))
                h += r["token_ids"]
    return asked


def test_multi_turn_chat_hits_the_cache_and_keeps_greedy_output(service, tiny_reference):
    svc, address = service
    rng = random.Random(5)
    system = [rng.randrange(256) for _ in range(70)]
    asked = run_async(chat(address, [system + [i] for i in range(4)], turns=4, rng=rng))
    ref = tiny_reference([p for p, _ in asked], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    assert [a for _, a in asked] == [r.output_ids for r in ref]
    wait_blocks_returned(svc)
    nodes = svc.node_info()
    info = [i for (role, _), i in nodes.items() if role == "prefill"]
    decode = [i for (role, _), i in nodes.items() if role == "decode"][0]
    hits, queries = sum(i["prefix_hit_tokens"] for i in info), sum(i["prefix_query_tokens"] for i in info)
    assert queries == sum(len(p) for p, _ in asked)
    # Later turns reuse their history. (Not asserted here: that every turn goes where the previous one
    # ran. With concurrent turns the policy may move one when the loads it sees, partly from Status
    # polls 0.5 s old, outweigh the saving; tests/router/test_policy.py checks the routing itself.)
    assert hits > queries // 2
    assert sum(i["prefill_tokens"] for i in info) == queries - hits
    assert sum(i["prefix_hit_requests"] for i in info) >= 12  # every turn after the first
    # the decode node held each turn's history: only the rest crossed the wire
    full = sum(-(-len(p) // 16) for p, _ in asked)  # prompt blocks, all sent without a decode-side cache
    sent, skipped = sum(i["kv_bytes"] for i in info), sum(i["kv_skipped_bytes"] for i in info)
    assert sent == decode["kv_bytes"] and skipped == decode["kv_skipped_bytes"]
    assert sent + skipped == full * block_bytes(k=3)  # every prompt block either sent or held by D
    assert skipped > sent and decode["prefix_hit_requests"] >= 12  # every turn after the first
    for _ in range(60):  # node figures reach /metrics with the router's next Status poll
        samples = scrape(svc)
        if (total(samples, "pdserve:prefix_cache_hits_total", kind="prefill") == hits
                and total(samples, "pdserve:kv_transfer_skipped_bytes_total", kind="decode") == skipped):
            break
        time.sleep(0.5)
    assert total(samples, "pdserve:prefix_cache_queries_total", kind="prefill") == queries
    assert total(samples, "pdserve:prefix_cache_hits_total", kind="prefill") == hits
    assert total(samples, "pdserve:kv_transfer_skipped_bytes_total", kind="prefill") == skipped
    assert total(samples, "pdserve:prefix_cache_hit_requests_total", kind="decode") == decode["prefix_hit_requests"]
    assert 0.5 < max(v for (n, ls), v in samples.items()
                     if n == "pdserve:prefix_cache_hit_rate" and ("of", "tokens") in ls) <= 1.0
