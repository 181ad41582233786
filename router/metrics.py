"""Prometheus metrics for the whole service, served by the router at `/metrics`.

Receives lifecycle events from router.py (`started`, `tokens`, `ended`, `refused`,
`prefilled`) and, at scrape time, reads the router's queue and every node's last `Status`
(the NodePool polls each node every `status_interval_s`), so one scrape sees router and
nodes alike. Hands prometheus-client a registry of its own per Router (tests run several).
Names follow vLLM's (`vllm:` -> `pdserve:`). Nothing here blocks or talks to a node.

Counting rules (a test checks them): every request the router saw ends in exactly one of
`request_success_total{finished_reason}` and `request_failure_total{code}` (refusals before
start included; a client that went away is code CANCELLED). TTFT is observed once per request
whose first token was written to its client, with each of its parts (router/ttft.py), so the parts'
sums add up to the TTFT's sum; inter-token latency once per later token (a message of n tokens after a
gap g observes g/n n times), end-to-end latency once per finished request.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families

from protos.messages import KV_TRANSFER_BUCKETS

log = logging.getLogger(__name__)
LOGGED_FIRST = 8  # the first requests of a router process whose TTFT parts it logs (`first_token_written`)

if TYPE_CHECKING:
    from router.pool import Node
    from router.request import RequestState

TTFT_PART_METRICS = {  # part (router/ttft.py) -> histogram name (vLLM's where it has one), help
    "parse": ("request_parse_time_seconds", "TTFT part: the request body read and parsed (HTTP; gRPC: ~0)"),
    "tokenize": ("request_tokenize_time_seconds", "TTFT part: chat template, validation and tokenization"),
    "queue": ("request_queue_time_seconds", "TTFT part: waiting in the router's queue for a decode node"),
    "reserve": ("request_reserve_time_seconds", "TTFT part: Reserve calls on decode nodes (Submit on a colocated one)"),
    "prefill_queue": ("request_prefill_queue_time_seconds", "TTFT part: queued on the prefill (or colocated) "
                      "node, as the node measured it"),
    "prefill": ("request_prefill_time_seconds", "TTFT part: the prompt's prefill up to its first token on the "
                "host, as the prefill (or colocated) node measured it"),
    "return": ("request_first_token_return_time_seconds", "TTFT part: the rest of the prefill call (the first "
               "token's way back to the router; the call's way there)"),
    "write": ("request_first_token_write_time_seconds", "TTFT part: from the first token's arrival at the router "
              "to its write to the client (detokenizing, the SSE or gRPC frame)"),
}
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                   7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
PART_BUCKETS = (0.0001, 0.00025, 0.0005, *LATENCY_BUCKETS)  # a TTFT part is often well under a millisecond


class RouterMetrics:
    def __init__(self, model_name: str, queue_depth: Callable[[], int], running: Callable[[], int],
                 nodes: Callable[[], list[Node]], node_downs: Callable[[], Mapping[str, int]] = dict) -> None:
        self.registry = CollectorRegistry()
        r, labels = self.registry, ["model_name"]

        def histogram(name: str, doc: str, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> Any:
            return Histogram(f"pdserve:{name}", doc, labels, buckets=buckets, registry=r).labels(model_name)

        self.ttft = histogram("time_to_first_token_seconds", "Time to first token (the front door's receipt to the "
                              "first token written to the client)")
        self.itl = histogram("inter_token_latency_seconds", "Time between output tokens")
        self.e2e = histogram("e2e_request_latency_seconds", "End-to-end latency of finished requests")
        # where a request's TTFT goes (router/ttft.py): observed with it, so each request's parts add up to it
        self.ttft_parts = {part: histogram(name, doc, PART_BUCKETS)
                           for part, (name, doc) in TTFT_PART_METRICS.items()}
        self.success = Counter("pdserve:request_success", "Finished requests by finish reason",
                               [*labels, "finished_reason"], registry=r)
        self.failure = Counter("pdserve:request_failure", "Requests ended by an error (gRPC code name)",
                               [*labels, "code"], registry=r)
        self.prompt_tokens = Counter("pdserve:prompt_tokens", "Prompt tokens of started requests",
                                     labels, registry=r).labels(model_name)
        generation_tokens = Counter("pdserve:generation_tokens", "Output tokens sent to clients",
                                    labels, registry=r).labels(model_name)
        self.tally = TokenTally(generation_tokens, self.itl)  # read into both at every exposition
        self.first_seen = 0  # requests whose first token was written, up to LOGGED_FIRST
        self.migrations = Counter("pdserve:request_migrations", "Requests moved to another decode node "
                                  "(each move counts)", labels, registry=r).labels(model_name)
        self.prefill_abandoned = Counter(
            "pdserve:prefill_abandoned_tokens", "Prompt tokens of Prefill requests the router gave up on (no decode "
            "node admitted at once, a failed reservation or Prefill request): the prefill node may have computed them",
            [*labels, "reason"], registry=r)
        Gauge("pdserve:num_requests_waiting", "Requests queued for a decode node", registry=r).set_function(
            lambda: float(queue_depth()))
        Gauge("pdserve:num_requests_router", "Requests in flight in the router", registry=r).set_function(
            lambda: float(running()))
        self.model_name = model_name
        r.register(NodeCollector(nodes, node_downs))

    def exposition(self) -> tuple[bytes, str]:
        self.tally.flush()
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    # ---- lifecycle events ---------------------------------------------------------------
    def started(self, st: RequestState) -> None:
        self.prompt_tokens.inc(len(st.prep.prompt_ids))

    def tokens(self, st: RequestState, n: int) -> None:
        """`n` new tokens of `st` went to its client now."""
        if n <= 0:
            return
        now = time.monotonic()
        last, st.last_token_at = st.last_token_at, now
        # the first token's TTFT is observed once it is written (`first_token_written`)
        self.tally.add(n, None if last is None else (now - last) / n)

    def first_token_written(self, st: RequestState) -> None:
        """`st`'s first token was written to its client now: its TTFT and the TTFT's parts."""
        timeline = st.timeline
        if timeline.written:
            return
        timeline.lap("write")
        timeline.written = True
        self.ttft.observe(timeline.total)
        for part, seconds in timeline.parts.items():
            self.ttft_parts[part].observe(seconds)
        if self.first_seen < LOGGED_FIRST:  # the first requests after a start meet what the histograms blur
            self.first_seen += 1
            log.info("request %d's TTFT %.2f ms: %s", self.first_seen, 1e3 * timeline.total,
                     ", ".join(f"{part} {1e3 * s:.2f}" for part, s in timeline.parts.items()))

    def ended(self, st: RequestState) -> None:
        terminal = st.terminal or "error:INTERNAL"
        kind, _, what = terminal.partition(":")
        if kind == "finished":
            self.success.labels(self.model_name, what).inc()
            self.e2e.observe(time.monotonic() - st.arrival)
        else:
            self.refused("CANCELLED" if kind == "cancelled" else what)

    def refused(self, code: str) -> None:
        self.failure.labels(self.model_name, code).inc()


def merge_expositions(own: bytes, others: list[bytes]) -> bytes:
    """One exposition for a service of several router processes: `own` (this process's) with every
    request-level sample of `others` (the other processes') added to it, so each counter,
    histogram bucket and gauge is the service's total. Per-node families (NodeCollector: every
    process polls the same nodes) and `_created` stamps are taken from `own`."""
    families = list(text_string_to_metric_families(own.decode()))
    by_name = {f.name: f for f in families}
    for text in others:
        for fam in text_string_to_metric_families(text.decode()):
            mine = by_name.get(fam.name)
            if mine is None:
                families.append(fam)
                by_name[fam.name] = fam
            elif fam.name not in NODE_FAMILIES and not fam.name.endswith("_created"):
                _add_samples(mine, fam)
    return generate_latest(_Families(families))  # type: ignore[arg-type]


def _add_samples(into: Any, fam: Any) -> None:
    index = {(s.name, tuple(sorted(s.labels.items()))): i for i, s in enumerate(into.samples)}
    for s in fam.samples:
        i = index.get((s.name, tuple(sorted(s.labels.items()))))
        if i is None:
            into.samples.append(s)
        else:
            into.samples[i] = into.samples[i]._replace(value=into.samples[i].value + s.value)


class _Families:
    """A collection `generate_latest` can render (it only calls `collect`)."""

    def __init__(self, families: list[Any]) -> None:
        self.families = families

    def collect(self) -> list[Any]:
        return self.families


class TokenTally:
    """Output tokens and their inter-token latencies counted in plain numbers, added to the
    Prometheus counter and histogram in one step when they are read (`flush`): the per-token path
    takes none of their locks. A histogram that does not keep its buckets as `observe_n` reads them
    is observed at once instead."""

    def __init__(self, counter: Any, histogram: Any) -> None:
        self.counter, self.histogram = counter, histogram
        bounds, buckets = getattr(histogram, "_upper_bounds", None), getattr(histogram, "_buckets", None)
        self.bounds = list(bounds) if bounds is not None and buckets is not None and len(bounds) == len(buckets) else None
        self.tokens, self.sum = 0, 0.0
        self.counts = [0] * len(self.bounds or ())

    def add(self, n: int, gap: float | None) -> None:
        """`n` tokens sent together; `gap`: each one's inter-token latency (observed n times), or
        None for a request's first message (no latency observed)."""
        self.tokens += n
        if gap is None:
            return
        bounds = self.bounds
        if bounds is None:
            observe_n(self.histogram, gap, n)
            return
        self.sum += gap * n
        self.counts[min(bisect.bisect_left(bounds, gap), len(bounds) - 1)] += n

    def flush(self) -> None:
        if self.tokens:
            self.counter.inc(self.tokens)
            self.tokens = 0
        if self.sum or any(self.counts):
            self.histogram._sum.inc(self.sum)
            for bucket, count in zip(self.histogram._buckets, self.counts, strict=True):
                if count:
                    bucket.inc(count)
            self.sum, self.counts = 0.0, [0] * len(self.counts)


def observe_n(histogram: Any, value: float, n: int) -> None:
    """`histogram.observe(value)` n times, in one step: one bucket and the sum move by n (the
    bucket `observe` picks: the first bound >= value). Falls back to n observes should the
    client library's histogram keep its buckets otherwise."""
    bounds, buckets = getattr(histogram, "_upper_bounds", None), getattr(histogram, "_buckets", None)
    if bounds is None or buckets is None or len(bounds) != len(buckets):
        for _ in range(n):
            histogram.observe(value)
        return
    histogram._sum.inc(value * n)
    buckets[min(bisect.bisect_left(bounds, value), len(buckets) - 1)].inc(n)


class NodeCollector:
    """Per-node figures from each node's last Status and the router's view of its health, read at
    scrape time; `node_downs`: nodes taken out of service so far, by kind (they outlive the node)."""

    def __init__(self, nodes: Callable[[], list[Node]], node_downs: Callable[[], Mapping[str, int]] = dict) -> None:
        self.nodes, self.node_downs = nodes, node_downs

    def describe(self) -> list:
        return []  # collected on scrape only (the node set changes)

    def collect(self) -> Iterator[Any]:
        keys = ["node", "kind"]
        running = GaugeMetricFamily("pdserve:node_running_requests", "Requests decoding (D) or prefilling (P)", labels=keys)
        healthy = GaugeMetricFamily("pdserve:node_healthy", "1 while the router routes to the node", labels=keys)
        used = GaugeMetricFamily("pdserve:kv_blocks_used", "KV cache blocks in use", labels=keys)
        free = GaugeMetricFamily("pdserve:kv_blocks_free", "KV cache blocks free", labels=keys)
        total = GaugeMetricFamily("pdserve:kv_blocks_total", "KV cache blocks in all (free < total at rest: a leak)",
                                  labels=keys)
        queued = GaugeMetricFamily("pdserve:node_queued_prompt_tokens", "Prompt tokens waiting (P)", labels=keys)
        shared = GaugeMetricFamily("pdserve:kv_blocks_shared", "KV cache blocks in use by more than one request "
                                   "(n > 1 choices, prefix hits)", labels=keys)
        prefix, graphs = self._prefix_families(keys), self._graph_families(keys)
        families = [running, healthy, used, free, total, queued, shared, *self._counters(keys)]
        health = self._health_families(keys)
        for node in self.nodes():
            s, key = node.status, [node.address, node.kind]
            healthy.add_metric(key, 1.0 if node.healthy else 0.0)
            self._add_health(health, key, node)
            if s is None:
                continue
            running.add_metric(key, s.running)
            used.add_metric(key, s.total_blocks - s.free_blocks)
            free.add_metric(key, s.free_blocks)
            total.add_metric(key, s.total_blocks)
            queued.add_metric(key, s.queued_tokens)
            shared.add_metric(key, s.shared_blocks)
            self._add_counters(families[7:], key, s)
            self._add_prefix(prefix, key, s)
            graphs[0].add_metric(key, s.cold_shape_steps)
            graphs[1].add_metric(key, s.graph_shapes_pending)
        yield from families + prefix + health + graphs

    def _health_families(self, keys: list[str]) -> list[Any]:
        """Status calls that failed, a late answer (DEADLINE_EXCEEDED: busy) apart from an unreachable
        node (UNAVAILABLE: a refused connection), and nodes taken out of service."""
        downs = CounterMetricFamily("pdserve:node_failures", "Nodes the router took out of service (unreachable, "
                                    "a broken output stream, Status late too often, unhealthy by its own word, "
                                    "removed), by kind", labels=["kind"])
        for kind, n in sorted(self.node_downs().items()):
            downs.add_metric([kind], n)
        return [CounterMetricFamily("pdserve:node_status_failures", "Status calls to the node that failed, by gRPC "
                                    "code (DEADLINE_EXCEEDED: answered late; UNAVAILABLE: unreachable)",
                                    labels=[*keys, "code"]), downs]

    @staticmethod
    def _add_health(families: list[Any], key: list[str], node: Node) -> None:
        for code, n in sorted(node.status_failures.items()):
            families[0].add_metric([*key, code], n)

    @staticmethod
    def _graph_families(keys: list[str]) -> list[Any]:
        """The warm-up's reach (engine/runner/warmup.py): 0 and 0 once the node captured every shape."""
        return [
            CounterMetricFamily("pdserve:cold_shape_steps", "Steps that met a shape with no CUDA graph yet "
                                "(run eagerly) (P, D)", labels=keys),
            GaugeMetricFamily("pdserve:graph_shapes_pending", "Step shapes the node still captures when idle "
                              "(P, D)", labels=keys),
        ]

    @staticmethod
    def _counters(keys: list[str]) -> list[Any]:
        return [
            CounterMetricFamily("pdserve:prefill_tokens", "Prompt tokens prefilled (P); rate() = prefill tokens/s", labels=keys),
            CounterMetricFamily("pdserve:prefill_seconds", "Seconds spent in prefill steps (P)", labels=keys),
            CounterMetricFamily("pdserve:kv_transfer_bytes", "KV bytes pushed (P) or received (D)", labels=keys),
            HistogramMetricFamily("pdserve:kv_transfer_seconds", "A request's KV transfer (P): from its last "
                                  "layer queued to the decode node's acknowledgement", labels=keys),
            CounterMetricFamily("pdserve:kv_transfer_skipped_bytes", "KV bytes not pushed (P) or received (D): "
                                "the decode node's prefix cache held them", labels=keys),
            CounterMetricFamily("pdserve:spec_decode_num_draft_tokens", "MTP drafts verified, per draft position (D)",
                                labels=[*keys, "position"]),
            CounterMetricFamily("pdserve:spec_decode_num_accepted_tokens_per_pos",
                                "MTP drafts accepted, per draft position (D)", labels=[*keys, "position"]),
            CounterMetricFamily("pdserve:spec_decode_num_steps", "Decode steps by the drafts each verified a row, k "
                                "(D; adaptive k runs K or 0)", labels=[*keys, "k"]),
        ]

    @staticmethod
    def _prefix_families(keys: list[str]) -> list[Any]:
        """Prefix cache of prefill and decode nodes (as vLLM's prefix_cache_queries/hits, in tokens), by
        requests too; select with the `kind` label (0 where a node's cache is off)."""
        return [
            CounterMetricFamily("pdserve:prefix_cache_queries", "Prompt tokens looked up in the prefix cache (P, D)",
                                labels=keys),
            CounterMetricFamily("pdserve:prefix_cache_hits", "Prompt tokens found in the prefix cache (P, D)", labels=keys),
            CounterMetricFamily("pdserve:prefix_cache_query_requests", "Requests looked up in the prefix cache (P, D)",
                                labels=keys),
            CounterMetricFamily("pdserve:prefix_cache_hit_requests", "Requests that found a cached prefix (P, D)",
                                labels=keys),
            GaugeMetricFamily("pdserve:prefix_cache_hit_rate", "Hits / queries since the node started, "
                              "of prompt tokens or of requests (P, D)", labels=[*keys, "of"]),
            GaugeMetricFamily("pdserve:prefix_cache_blocks", "KV blocks held by the prefix cache (P, D)", labels=keys),
        ]

    @staticmethod
    def _add_prefix(families: list[Any], key: list[str], s: Any) -> None:
        queries, hits, query_reqs, hit_reqs, rate, blocks = families
        queries.add_metric(key, s.prefix_query_tokens)
        hits.add_metric(key, s.prefix_hit_tokens)
        query_reqs.add_metric(key, s.prefix_requests)
        hit_reqs.add_metric(key, s.prefix_hit_requests)
        rate.add_metric([*key, "tokens"], s.prefix_hit_tokens / s.prefix_query_tokens if s.prefix_query_tokens else 0.0)
        rate.add_metric([*key, "requests"], s.prefix_hit_requests / s.prefix_requests if s.prefix_requests else 0.0)
        blocks.add_metric(key, s.cached_blocks)

    @staticmethod
    def _add_counters(families: list[Any], key: list[str], s: Any) -> None:
        tokens, seconds, kv_bytes, kv_seconds, kv_skipped, drafts, accepted, k_steps = families
        tokens.add_metric(key, s.prefill_tokens)
        seconds.add_metric(key, s.prefill_seconds)
        kv_bytes.add_metric(key, s.kv_bytes)
        buckets = list(s.kv_seconds_buckets)
        if len(buckets) == len(KV_TRANSFER_BUCKETS) + 1 and min(buckets) >= 0:  # P only; a malformed list is left out
            bounds = [*(f"{b:g}" for b in KV_TRANSFER_BUCKETS), "+Inf"]
            cumulative = [float(c) for c in itertools.accumulate(buckets)]
            kv_seconds.add_metric(key, list(zip(bounds, cumulative, strict=True)), s.kv_seconds)
        kv_skipped.add_metric(key, s.kv_skipped_bytes)
        for pos, (d, a) in enumerate(zip(s.draft_tokens, s.accepted_per_pos, strict=False)):
            drafts.add_metric([*key, str(pos)], d)
            accepted.add_metric([*key, str(pos)], a)
        for k, n in enumerate(s.spec_decode_steps):
            k_steps.add_metric([*key, str(k)], n)


NODE_FAMILIES = frozenset(f.name for f in NodeCollector(lambda: []).collect())
