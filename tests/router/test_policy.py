"""Node choices: least-load (Status + the router's own counts) and round robin, as units and
through the router; the NodeDirectory; Health and ListModels."""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest

from router import LeastLoad, NodeDirectory, PrefixAware, RoundRobin, make_policy
from router.policy import NodeLoad, chunk_hashes
from tests.router.conftest import MAX_MODEL_LEN, cluster
from tests.router.test_lifecycle import collect


def test_least_load_orders_by_free_blocks_then_running():
    nodes = [NodeLoad("a:1", free_blocks=10), NodeLoad("b:1", free_blocks=50, running=3),
             NodeLoad("c:1", free_blocks=50, running=1, inflight=1), NodeLoad("d:1", free_blocks=50)]
    assert [n.address for n in LeastLoad().order_decode(nodes)] == ["d:1", "c:1", "b:1", "a:1"]


def test_least_load_weighs_free_kv_against_the_batch():
    """A little more free KV does not outrank a far larger batch; and between two Status polls
    (free blocks as last reported) a burst spreads over every decode node, the roomier taking more."""
    busy, idle = NodeLoad("a:1", free_blocks=110, running=10), NodeLoad("b:1", free_blocks=100, running=1)
    assert [n.address for n in LeastLoad().order_decode([busy, idle])] == ["b:1", "a:1"]
    loads = {a: NodeLoad(a, free_blocks=f) for a, f in (("a:1", 1000), ("b:1", 900), ("c:1", 500))}
    policy, picks = LeastLoad(), []
    for _ in range(24):
        first = policy.order_decode(list(loads.values()))[0]
        picks.append(first.address)
        loads[first.address] = replace(first, inflight=first.inflight + 1)  # the router's count moves at once
    assert picks.count("a:1") >= picks.count("b:1") >= picks.count("c:1") > 0


def test_least_load_prefill_counts_queued_and_outstanding_tokens():
    nodes = [NodeLoad("a:1", queued_tokens=100), NodeLoad("b:1", inflight_tokens=50, inflight=1),
             NodeLoad("c:1", queued_tokens=20, inflight_tokens=20, inflight=1)]
    assert [n.address for n in LeastLoad().order_prefill(nodes)] == ["c:1", "b:1", "a:1"]


def test_round_robin_rotates_per_kind():
    rr, nodes = RoundRobin(), [NodeLoad("b:1"), NodeLoad("a:1"), NodeLoad("c:1")]
    firsts = [rr.order_decode(nodes)[0].address for _ in range(4)]
    assert firsts == ["a:1", "b:1", "c:1", "a:1"]
    assert rr.order_prefill(nodes)[0].address == "a:1"  # its own cursor
    assert [n.address for n in rr.order_decode(nodes)] == ["b:1", "c:1", "a:1"]  # all, rotated
    assert rr.order_decode([]) == []
    with pytest.raises(ValueError, match="unknown routing policy"):
        make_policy("random")


async def test_least_load_choices_follow_status_polls():
    async with cluster(n_prefill=2, n_decode=2) as c:
        (p0, p1), (d0, d1) = c.prefill, c.decode
        d0.free_blocks_report, p0.queued_tokens = 10, 500
        await c.router.refresh()
        await collect(c, prompt="ab", max_tokens=3)
        assert (len(d0.admitted), len(d1.admitted), len(p0.calls), len(p1.calls)) == (0, 1, 0, 1)
        d0.free_blocks_report, d1.free_blocks_report, p0.queued_tokens, p1.queued_tokens = 900, 20, 0, 700
        await c.router.refresh()
        await collect(c, prompt="ab", max_tokens=3)
        assert (len(d0.admitted), len(d1.admitted), len(p0.calls), len(p1.calls)) == (1, 1, 1, 1)
        await c.settled()


async def test_least_load_refused_reserve_falls_through_to_the_next_decode_node():
    async with cluster(n_decode=2) as c:
        d0, d1 = c.decode
        d1.free_blocks_report = 1
        await c.router.refresh()
        d0.refuse = True
        msgs = await collect(c, prompt="ab", max_tokens=3)
        assert msgs[-1].finished.reason == "length"
        assert len(d0.reserves) == 1 and not d0.admitted and len(d1.admitted) == 1
        await c.settled()


async def test_round_robin_spreads_requests_evenly():
    async with cluster(n_prefill=2, n_decode=2, policy="round_robin") as c:
        picks = []
        for _ in range(4):
            before = [len(d.admitted) for d in c.decode] + [len(p.calls) for p in c.prefill]
            await collect(c, prompt="ab", max_tokens=2)
            after = [len(d.admitted) for d in c.decode] + [len(p.calls) for p in c.prefill]
            picks.append(tuple(i for i, (x, y) in enumerate(zip(before, after, strict=True)) if y > x))
        assert picks[0] == picks[2] and picks[1] == picks[3]  # alternating, for D and for P
        assert set(picks[0]).isdisjoint(picks[1]) and all(len(p) == 2 for p in picks)
        await c.settled()


async def test_health_and_list_models():
    async with cluster(n_prefill=2, n_decode=3) as c:
        h = await c.client.health()
        assert (h.serving, h.prefill_nodes, h.decode_nodes, h.running_requests) == (True, 2, 3, 0)
        models = (await c.client.list_models()).models
        assert len(models) == 1
        assert (models[0].name, models[0].max_model_len, models[0].num_speculative_tokens) == (
            "tiny", MAX_MODEL_LEN, 2)


def test_node_directory_is_thread_safe_and_notifies():
    d = NodeDirectory(["p:1"], ["d:1"])
    seen: list[tuple[str, ...]] = []
    unsubscribe = d.subscribe(lambda: seen.append(d.addresses("decode")))
    threads = [threading.Thread(target=d.add, args=("decode", f"d:{i}")) for i in range(2, 12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(d.addresses("decode")) == 11 and len(seen) == 10
    assert d.add("decode", "d:1") is False and len(seen) == 10  # already listed: no notification
    d.replace("decode", "d:1", "d:99")
    assert "d:1" not in d.addresses("decode") and "d:99" in d.addresses("decode")
    assert d.remove("prefill", "p:1") and not d.remove("prefill", "p:1")
    unsubscribe()
    d.add("prefill", "p:2")
    assert len(seen) == 12
    with pytest.raises(ValueError, match="host:port"):
        d.add("decode", "no-port")
    with pytest.raises(ValueError, match="node kind"):
        d.add("router", "x:1")  # type: ignore[arg-type]


# ---- the prefix (cache-aware) policy ---------------------------------------------------------
def order(policy, nodes, prompt):
    return [n.address for n in policy.order_prefill(nodes, prompt)]


def test_prefix_policy_prefers_the_node_sent_the_longest_prefix():
    pol = PrefixAware(block_size=4)
    nodes = [NodeLoad("a:1"), NodeLoad("b:1")]
    system = list(range(100, 120))
    assert pol.routed("b:1", system + [1, 2, 3, 4, 5]) == 25  # nothing cached yet: all of it
    pol.routed("a:1", system[:8] + [7] * 9)
    assert pol.routed("b:1", system + [6]) == 1  # 20 of 21 there
    assert order(pol, nodes, system + [9, 9, 9, 9, 9, 9]) == ["b:1", "a:1"]  # 20 tokens vs 8
    assert order(pol, nodes, system[:8] + [7] * 12) == ["a:1", "b:1"]
    assert pol.matched("b:1", chunk_hashes(system + [9], 4)) == 20
    assert pol.matched("b:1", chunk_hashes([5] + system, 4)) == 0  # a chain: the first chunk differs


def test_prefix_policy_weighs_the_saving_against_the_load():
    pol = PrefixAware(block_size=4, balance_abs_tokens=10_000)
    prompt = list(range(41))
    pol.routed("a:1", prompt)  # a has 40 of its tokens
    assert order(pol, [NodeLoad("a:1", queued_tokens=30), NodeLoad("b:1")], prompt) == ["a:1", "b:1"]
    assert order(pol, [NodeLoad("a:1", queued_tokens=50), NodeLoad("b:1")], prompt) == ["b:1", "a:1"]


def test_prefix_policy_falls_back_to_least_load_when_unbalanced_or_nothing_matches():
    pol = PrefixAware(block_size=4, balance_abs_tokens=100, balance_rel=2.0)
    prompt = list(range(400))
    pol.routed("a:1", prompt)
    busy = [NodeLoad("a:1", queued_tokens=150), NodeLoad("b:1", queued_tokens=20)]
    assert order(pol, busy, prompt) == ["b:1", "a:1"]  # 130 > 100 and 150 > 2 x 20
    near = [NodeLoad("a:1", queued_tokens=150), NodeLoad("b:1", queued_tokens=80)]
    assert order(pol, near, prompt) == ["a:1", "b:1"]  # 150 < 2 x 80: balanced enough
    fresh = [NodeLoad("a:1"), NodeLoad("b:1", inflight_tokens=5, inflight=1), NodeLoad("c:1")]
    assert order(pol, fresh, [1, 2, 3]) == ["c:1", "a:1", "b:1"]  # no match: least load, then least sent


def test_prefix_policy_views_are_bounded_lru():
    pol = PrefixAware(block_size=2, view_blocks=4)
    old, new = list(range(9)), list(range(50, 59))  # 4 chunks each
    pol.routed("a:1", old)
    pol.routed("a:1", new)
    assert pol.matched("a:1", chunk_hashes(old, 2)) == 0
    assert pol.matched("a:1", chunk_hashes(new, 2)) == 8
    assert make_policy("prefix", block_size=2).name == "prefix"
    assert [n.address for n in pol.order_decode([NodeLoad("a:1", free_blocks=1), NodeLoad("b:1", free_blocks=9)])] \
        == ["b:1", "a:1"]


async def test_prefix_policy_through_the_router_keeps_a_conversation_on_one_prefill_node():
    async with cluster(n_prefill=2, policy="prefix") as c:
        p0, p1 = c.prefill
        system = "You are a helpful assistant. Answer briefly and politely. "
        for turn in range(3):
            await collect(c, prompt=system + "Tell me about the sea. " * (turn + 1), max_tokens=2)
        first = p0 if p0.calls else p1
        assert len(first.calls) == 3  # every turn went where its prefix was
        await collect(c, prompt="x" * 70, max_tokens=2)  # nothing in common: the node sent less
        other = p1 if first is p0 else p0
        assert len(other.calls) == 1
        await c.settled()
