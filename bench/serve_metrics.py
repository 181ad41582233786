"""Where a run's TTFT goes, from the server's own Prometheus counters (`bench serve`, HTTP target).

`bench serve` reads `/metrics` before and after each rate's run and hands on, per run, the means of
what the service measured itself over it: the router's TTFT (`time_to_first_token_seconds`, from
the request's receipt at the router's door to its first token written to the client) and the mean
of each of its parts (`ttft_<part>_mean_ms`: HTTP parse, tokenization, the router's queue, the
reservation, the prefill node's queue and compute, the first token's return and its write; they
add up to the TTFT's mean, router/ttft.py), the prefill nodes' step time per
completed request (`prefill_seconds`: the steps' host-measured time, the device's work included)
and the KV transfer time (PD): its mean per completed request, and over the run's transfers
(`kv_transfer_seconds`, a histogram: from a request's last layer queued on the prefill node to
the decode node's acknowledgement) their mean, and p50 and p99 estimated from the buckets as
Prometheus' `histogram_quantile` does (linear within a bucket). Against the client's TTFT, these split
the time into the client's side (what the router's TTFT leaves out) and the router's parts. A server
without these metrics (another vendor's) gives an empty breakdown.
"""

from __future__ import annotations

import math
import re
import time
import urllib.request

TTFT_PARTS = {  # the router's TTFT parts (router/metrics.py's TTFT_PART_METRICS), in request order
    "parse": "request_parse_time_seconds", "tokenize": "request_tokenize_time_seconds",
    "queue": "request_queue_time_seconds", "reserve": "request_reserve_time_seconds",
    "prefill_queue": "request_prefill_queue_time_seconds", "prefill": "request_prefill_time_seconds",
    "return": "request_first_token_return_time_seconds", "write": "request_first_token_write_time_seconds"}
_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfNa]+)$")
WANTED = ("pdserve:time_to_first_token_seconds_sum", "pdserve:time_to_first_token_seconds_count",
          "pdserve:prefill_seconds", "pdserve:prefill_tokens", "pdserve:kv_transfer_seconds_sum",
          "pdserve:kv_transfer_seconds_count", "pdserve:kv_transfer_seconds_bucket",
          "pdserve:kv_blocks_used", "pdserve:cold_shape_steps",
          *(f"pdserve:{name}_{end}" for name in TTFT_PARTS.values() for end in ("sum", "bucket")))
_LE = re.compile(r'le="([^"]*)"')
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
    """WANTED families summed over label sets; a histogram's buckets apart, as `NAME_bucket|LE`."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _LINE.match(line.strip())
        name = m.group(1).removesuffix("_total") if m else ""  # counters are exposed as NAME_total
        if m and name in WANTED:
            le = _LE.search(m.group(2) or "") if name.endswith("_bucket") else None
            key = f"{name}|{le.group(1)}" if le else name
            out[key] = out.get(key, 0.0) + float(m.group(3))
    return out


def histogram_quantile(q: float, buckets: dict[float, float]) -> float:
    """The q-quantile of a histogram given as {upper bound: cumulative count}, linear within the
    bucket it falls in (Prometheus' rule; in the +Inf bucket: the highest finite bound); nan when empty."""
    bounds = sorted(buckets)
    total = buckets[bounds[-1]] if bounds else 0.0
    if total <= 0:
        return math.nan
    rank, lower, below = q * total, 0.0, 0.0
    for le in bounds:
        count = buckets[le]
        if count >= rank:
            if math.isinf(le):
                return lower
            return lower + (le - lower) * ((rank - below) / (count - below) if count > below else 1.0)
        lower, below = le, count
    return lower


def breakdown(before: dict[str, float], after: dict[str, float], completed: int) -> dict[str, float]:
    """Per-request means (ms) over a run, from two scrapes; {} without both."""
    if not before or not after or completed <= 0:
        return {}

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    out = {}
    n = delta("pdserve:time_to_first_token_seconds_count")
    if n > 0:  # each part is observed with the TTFT, once per request
        out["router_ttft_mean_ms"] = round(1000 * delta("pdserve:time_to_first_token_seconds_sum") / n, 2)
        parts = {part: 1000 * delta(f"pdserve:{name}_sum") / n for part, name in TTFT_PARTS.items()}
        if any(parts.values()):  # a router that measures them
            out.update({f"ttft_{part}_mean_ms": round(ms, 3) for part, ms in parts.items()})
            tails = {part: _buckets(before, after, name) for part, name in TTFT_PARTS.items()}
            out.update({f"ttft_{part}_p99_ms": round(1000 * histogram_quantile(0.99, b), 3)
                        for part, b in tails.items() if b})
    if "pdserve:cold_shape_steps" in after:  # steps whose shape had no graph yet (they ran eagerly)
        out["cold_shape_steps"] = delta("pdserve:cold_shape_steps")
    out["prefill_ms_per_request"] = round(1000 * delta("pdserve:prefill_seconds") / completed, 2)
    out["kv_transfer_ms_per_request"] = round(1000 * delta("pdserve:kv_transfer_seconds_sum") / completed, 2)
    out.update(_kv_transfers(before, after))
    return out


def _kv_transfers(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """The run's KV transfers from the `kv_transfer_seconds` histogram: count, mean, p50, p99 (ms)."""
    n = after.get("pdserve:kv_transfer_seconds_count", 0.0) - before.get("pdserve:kv_transfer_seconds_count", 0.0)
    if n <= 0:
        return {}
    buckets = _buckets(before, after, "kv_transfer_seconds")
    total = after["pdserve:kv_transfer_seconds_sum"] - before.get("pdserve:kv_transfer_seconds_sum", 0.0)
    return {"kv_transfers": n, "kv_transfer_mean_ms": round(1000 * total / n, 3),
            **{f"kv_transfer_p{round(100 * q)}_ms": round(1000 * histogram_quantile(q, buckets), 3)
               for q in (0.5, 0.99)}}


def _buckets(before: dict[str, float], after: dict[str, float], name: str) -> dict[float, float]:
    """The histogram `pdserve:NAME`'s buckets over the run: {upper bound: cumulative count}."""
    prefix = f"pdserve:{name}_bucket|"
    return {float(k[len(prefix):]): v - before.get(k, 0.0) for k, v in after.items() if k.startswith(prefix)}


NODE_VIEW = ("pdserve:prefill_tokens", "pdserve:kv_transfer_seconds_count", "pdserve:kv_blocks_used")


def settle(base_url: str | None, before: dict[str, float], api_key: str | None = None,
           status_interval_s: float = 1.0, kv_timeout_s: float = 0.0) -> tuple[dict[str, float], dict[str, float]]:
    """Once a run is over: the nodes' KV blocks in use before it and now, and the scrape to take the
    run's figures from. The router's view of a node is its last Status poll (every
    `status_interval_s`), so scrapes repeat, each past the next poll, until two in a row agree on
    the nodes' figures with the blocks back to the run's start, or SETTLE_S passes, or longer with
    the service's `kv_transfer.timeout_s` (`kv_timeout_s`, when known): a decode node keeps the
    blocks of a request whose transfer failed in quarantine that long after the failure (late
    bytes must land nowhere live: decode_node/node.py), so a run whose last requests failed gets
    them back only then. Blocks still used after that are held by the run's requests: a leak
    (issue 27's check)."""
    if not before or "pdserve:kv_blocks_used" not in before:
        return {}, scrape(base_url, api_key) if before else {}
    wait_s = max(SETTLE_S, kv_timeout_s + 3 * status_interval_s)
    deadline, last = time.monotonic() + wait_s, scrape(base_url, api_key) or before
    while time.monotonic() < deadline:
        time.sleep(1.5 * status_interval_s)
        now = scrape(base_url, api_key) or last
        agree = all(now.get(k) == last.get(k) for k in NODE_VIEW)
        last = now
        if agree and now.get("pdserve:kv_blocks_used", 0.0) <= before["pdserve:kv_blocks_used"]:
            break
    return {"kv_blocks_used_before": before["pdserve:kv_blocks_used"],
            "kv_blocks_used_after": last.get("pdserve:kv_blocks_used", 0.0)}, last
