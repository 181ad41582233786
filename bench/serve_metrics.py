"""Where a run's TTFT goes, from the server's own Prometheus counters (`bench serve`, HTTP target).

`bench serve` reads `/metrics` before and after each rate's run and hands on, per run, the means of
what the service measured itself over it: the router's TTFT (`time_to_first_token_seconds`, from
the request's arrival at the router to its first token going out), the prefill nodes' step time per
completed request (`prefill_seconds`: the steps' host-measured time, the device's work included)
and the KV transfer seconds per request (PD). Against the client's TTFT, these split the time into
the HTTP/client side, the router and queues, and the prefill itself; the router's reservation
(Reserve on a decode node, Submit on a colocated one) and Prefill calls, as it timed them, split
the router's part. A server without these
metrics (another vendor's) gives an empty breakdown.
"""

from __future__ import annotations

import re
import time
import urllib.request

_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfNa]+)$")
WANTED = ("pdserve:time_to_first_token_seconds_sum", "pdserve:time_to_first_token_seconds_count",
          "pdserve:prefill_seconds", "pdserve:prefill_tokens", "pdserve:kv_transfer_seconds",
          "pdserve:kv_blocks_used", "pdserve:request_reserve_time_seconds_sum",
          "pdserve:request_reserve_time_seconds_count", "pdserve:request_prefill_time_seconds_sum",
          "pdserve:request_prefill_time_seconds_count")
SETTLE_S = 10.0  # how long after a run the nodes' used KV blocks may take to come back (status polls)


def scrape(base_url: str | None, api_key: str | None = None) -> dict[str, float]:
    """The WANTED families, each summed over its label sets; {} when there is nothing to read."""
    if not base_url:
        return {}
    req = urllib.request.Request(base_url.rstrip("/") + "/metrics")
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            text = resp.read().decode()
    except (OSError, ValueError):
        return {}
    return parse(text)


def parse(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _LINE.match(line.strip())
        name = m.group(1).removesuffix("_total") if m else ""  # counters are exposed as NAME_total
        if m and name in WANTED:
            out[name] = out.get(name, 0.0) + float(m.group(3))
    return out


def breakdown(before: dict[str, float], after: dict[str, float], completed: int) -> dict[str, float]:
    """Per-request means (ms) over a run, from two scrapes; {} without both."""
    if not before or not after or completed <= 0:
        return {}

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    out = {}
    n = delta("pdserve:time_to_first_token_seconds_count")
    if n > 0:
        out["router_ttft_mean_ms"] = round(1000 * delta("pdserve:time_to_first_token_seconds_sum") / n, 2)
    for phase in ("reserve", "prefill"):  # the router's view of the placement calls, per attempt
        calls = delta(f"pdserve:request_{phase}_time_seconds_count")
        if calls > 0:
            out[f"router_{phase}_call_mean_ms"] = round(1000 * delta(f"pdserve:request_{phase}_time_seconds_sum") / calls, 2)
    out["prefill_ms_per_request"] = round(1000 * delta("pdserve:prefill_seconds") / completed, 2)
    out["kv_transfer_ms_per_request"] = round(1000 * delta("pdserve:kv_transfer_seconds") / completed, 2)
    return out


def settle(base_url: str | None, before: dict[str, float], api_key: str | None = None) -> dict[str, float]:
    """The nodes' KV blocks in use before a run and once it is over: scrapes until they are back to
    the run's start (the router's view of a node is its last status poll) or SETTLE_S passes. A
    difference left is blocks the run's requests still hold: a leak (issue 27's check)."""
    if not before or "pdserve:kv_blocks_used" not in before:
        return {}
    deadline, after = time.monotonic() + SETTLE_S, before
    while True:
        after = scrape(base_url, api_key) or after
        if after.get("pdserve:kv_blocks_used", 0.0) <= before["pdserve:kv_blocks_used"] or time.monotonic() > deadline:
            break
        time.sleep(0.25)
    return {"kv_blocks_used_before": before["pdserve:kv_blocks_used"],
            "kv_blocks_used_after": after.get("pdserve:kv_blocks_used", 0.0)}
