"""`pdserve status`'s table (render), without a cluster: prefix cache hit rates per prefill node."""

from __future__ import annotations

from deploy.status import hit_rates, render


def test_status_table_shows_prefix_hit_rates_of_prefill_nodes():
    prefill = {"name": "pdserve-prefill-0", "role": "prefill", "state": "up", "prefix_query_tokens": 400,
               "prefix_hit_tokens": 300, "prefix_requests": 3, "prefix_hit_requests": 2}
    decode = {"name": "pdserve-decode-0", "role": "decode", "state": "up"}
    assert hit_rates(prefill) == ("75.0%", "66.7%")
    assert hit_rates(decode) == ("-", "-")  # nothing looked up (a decode node, or the cache off)
    lines = render({"router": {"state": "up", "serving": True}, "nodes": [decode, prefill]}).splitlines()
    assert "HIT TOK" in lines[1] and "HIT REQ" in lines[1]
    assert lines[2].startswith("pdserve-prefill-0") and "75.0%" in lines[2] and "66.7%" in lines[2]


def test_status_table_lists_colocated_nodes_after_the_others():
    colocated = {"name": "pdserve-colocated-0", "role": "colocated", "state": "up", "free_blocks": 10,
                 "total_blocks": 10, "running": 0}
    router = {"state": "up", "serving": True, "prefill_nodes": 0, "decode_nodes": 0, "colocated_nodes": 1}
    lines = render({"router": router, "nodes": [colocated]}).splitlines()
    assert "colocated=1" in lines[0]
    assert lines[2].startswith("pdserve-colocated-0 colocated up")


def test_status_table_marks_a_restarted_node_and_lists_the_routers_node_failures():
    decode = {"name": "pdserve-decode-0", "role": "decode", "state": "up", "restarted": True}
    prefill = {"name": "pdserve-prefill-0", "role": "prefill", "state": "up", "restarted": False}
    failure = {"at": 1_700_000_000.0, "kind": "decode", "address": "127.0.0.1:4000",
               "reason": "the Outputs stream broke: UNAVAILABLE"}
    router = {"state": "up", "serving": True, "node_failures": [failure]}
    lines = render({"router": router, "nodes": [decode, prefill]}).splitlines()
    assert lines[2].startswith("pdserve-prefill-0") and "(restarted)" not in lines[2]
    assert lines[3].startswith("pdserve-decode-0") and lines[3].endswith("(restarted)")
    assert lines[4].startswith("recent node failures") and "127.0.0.1:4000" in lines[5]
    assert "the Outputs stream broke" in lines[5]
