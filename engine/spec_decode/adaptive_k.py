"""Adaptive k: each decode step verifies K MTP drafts a row, or none (plain decoding), whichever
gives more tokens per second; MTP is then never much slower than plain decoding.

The step. With `spec.k_policy: adaptive` the decode node's runner captures two greedy graphs per
batch bucket at warm-up (engine/runner/cuda_graphs.py): the usual step at k = K (verify
[last, d1..dK], accept, redraft K) and the plain step at k = 0 (the target over [last] alone: no
drafts read, no MTP layer, no draft chain; it costs what a K = 0 engine's step costs). `step_costs`
times both per bucket on the device. A grammar-constrained step always runs at K (its masks cover
K + 1 positions), and without measured costs (the CPU, graphs off, or tensor parallelism, whose
ranks must agree on every step's k) the policy keeps K.

Why switching keeps output exact (the simplest scheme that does):
  * a k = 0 step leaves the slot's drafts, their distributions and the MTP layer's KV as they are;
  * the K step after it verifies those stale drafts. Verification does not care where drafts come
    from: a greedy row keeps a draft only where it equals the target's argmax, so its tokens are
    plain greedy decoding's whatever k each step ran at; a sampled row's stale drafts were drawn from
    the distributions stored beside them, and rejection sampling against the target keeps the
    target's distribution for any such proposal. Stale drafts are merely rejected (that step is then
    "verify none, draft K"), and the policy leaves that step's acceptance out of its measure;
  * the MTP layer's KV has no entries for positions decoded at k = 0: the drafts after a switch
    back attend over whatever those cache slots hold (zeros, or keys written there before: finite
    values, so the draft distributions stay distributions), which costs acceptance (a bias toward
    plain decoding, the safe side), never exactness. Running the MTP layer in every plain step
    would keep that cache whole, at a layer's cost in every step that drafts did not pay for.
What adaptive k gives up: a sampled request's tokens depend on the drafts it was offered, so with
a fixed seed they repeat only under the same sequence of k (a fixed k, or the same batch history).
Fix k (`spec.k_policy: fixed`, the default) where seeded answers must repeat across modes.

The rule (`KPolicy`, integers and floats only). A row gains E tokens per K step on average
(1 + accepted drafts: an exponential moving average over measured K steps); a K step of this
bucket costs cost(K), a plain one cost(0). K pays when E / cost(K) > 1 / cost(0), that is when
gain = E * cost(0) / cost(K) exceeds 1. The policy switches to K above 1 + margin and back to 0
below 1 + margin - hysteresis, so a gain near the threshold does not flip every step. At k = 0
nothing measures acceptance, so after `probe_every` plain steps it runs a probe of K steps: the
first verifies stale drafts and is not counted, then as many as give `probe_rows` rows' worth of
measure (one step at a large batch, up to `probe_steps` - 1 at a small one), and the first counted
one replaces the average: acceptance is re-measured rather than remembered. A probe costs K steps
where drafts did not pay, so each probe that ends in plain decoding doubles the wait for the next
(up to `max_probe_every`), and choosing K again resets it: where drafts never pay, probes soon
cost under 1% of the time.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class KPolicy:
    """Chooses each decode step's k (0 or `k`) from measured acceptance and per-bucket step costs.

    `choose(batch)` before each launch; `observe(k, rows, tokens, stale)` once a step is read (one
    step late in the overlapped loop). `costs`: batch bucket -> (seconds of a k = 0 step, seconds
    of a k = K step); a batch takes the smallest bucket that holds it (the largest beyond them).
    Empty costs: always K (today's behaviour)."""

    k: int
    costs: dict[int, tuple[float, float]] = field(default_factory=dict)
    margin: float = 0.05  # K must beat plain decoding by this share to be chosen
    hysteresis: float = 0.05  # ... and is kept until it beats it by margin - hysteresis
    probe_every: int = 64  # plain steps before the first re-measurement of acceptance
    max_probe_every: int = 2048  # ... doubling after each one that ends plain, up to this
    probe_steps: int = 4  # K steps a re-measurement runs at most (the first is not counted)
    probe_rows: int = 32  # ... and no more counted steps than give this many rows' tokens
    alpha: float = 0.125  # weight of a new step in the average of tokens per K step
    tokens_per_step: float | None = None  # the average E (None: not measured yet)
    at_k: bool = True  # the last decision (not counting probes)
    _plain_run: int = 0  # plain steps since the last K step
    _probe_left: int = 0  # K steps left in the current probe
    _probing: bool = False  # a probe ran and its outcome is not decided yet
    _remeasure: bool = False  # the next counted observation replaces the average
    _interval: int = 0  # plain steps before the next probe (probe_every, doubled per failed probe)

    def __post_init__(self) -> None:
        self._interval = self.probe_every
        if self.k < 0 or self.margin < 0 or self.hysteresis < 0 or not 0 < self.alpha <= 1:
            raise ValueError("KPolicy: k, margin and hysteresis must be >= 0 and alpha in (0, 1]")
        if (self.probe_every < 1 or self.max_probe_every < self.probe_every or self.probe_steps < 2
                or self.probe_rows < 1):
            raise ValueError("KPolicy: 1 <= probe_every <= max_probe_every, probe_steps >= 2 "
                             "(the first is not counted) and probe_rows >= 1")
        if any(c0 <= 0 or ck <= 0 for c0, ck in self.costs.values()):
            raise ValueError("KPolicy: step costs must be > 0")

    def cost(self, batch: int) -> tuple[float, float]:
        """(cost(0), cost(K)) of the bucket that runs `batch` rows."""
        bucket = min((b for b in self.costs if b >= batch), default=max(self.costs))
        return self.costs[bucket]

    def gain(self, batch: int) -> float | None:
        """Tokens per second at K over tokens per second plain (None: acceptance not measured)."""
        if self.tokens_per_step is None:
            return None
        c0, ck = self.cost(batch)
        return self.tokens_per_step * c0 / ck

    def choose(self, batch: int) -> int:
        """The k of the next step of `batch` rows."""
        if self.k == 0 or not self.costs:
            return self.k
        if self._probe_left > 0:
            self._probe_left -= 1
            return self.k
        gain = self.gain(batch)
        threshold = 1 + self.margin - (self.hysteresis if self.at_k else 0.0)
        self.at_k = gain is None or gain > threshold
        probed, self._probing = self._probing, False
        if self.at_k:
            self._plain_run, self._interval = 0, self.probe_every
            return self.k
        if probed:  # the probe did not bring K back: wait longer for the next
            self._interval = min(2 * self._interval, self.max_probe_every)
        self._plain_run += 1
        if self._plain_run > self._interval:
            self._plain_run, self._probe_left, self._remeasure, self._probing = 0, self._counted(batch), True, True
            return self.k
        return 0

    def _counted(self, batch: int) -> int:
        """The counted steps of a probe of `batch` rows (after its stale first step)."""
        return min(self.probe_steps - 1, -(-self.probe_rows // max(batch, 1)))

    def observe(self, k: int, rows: int, tokens: int, stale: bool = False) -> None:
        """A read step ran at `k` over `rows` rows that emitted `tokens` in all; `stale`: it verified
        drafts left from before a plain step (not counted)."""
        if k == 0 or rows == 0 or stale:
            return
        mean = tokens / rows
        if self.tokens_per_step is None or self._remeasure:
            self.tokens_per_step, self._remeasure = mean, False
        else:
            self.tokens_per_step += self.alpha * (mean - self.tokens_per_step)
