"""`bench serve`'s goodput, DistServe's way: per request whether it met both SLOs, per rate the
share that did (attainment), per layout the highest rate whose attainment reaches the target.

Receives a rate sweep's results (bench/serve_load.py `Result`s) and the SLOs; hands on plain
numbers for the report, the layouts' table and the attainment plot. Nothing here talks to a service.

Definitions (DistServe, OSDI '24):
- TPOT of a request: its mean inter-token latency, (last token - first token) / (tokens - 1); a
  request of one token has none and is judged by its TTFT alone.
- A request attains the SLOs when it finished, its TTFT <= the TTFT SLO and its TPOT <= the TPOT
  SLO; attainment at a rate = requests that attained / requests sent (a failed request misses).
- Goodput = the highest request rate whose attainment is >= the target (0.9). The sweep measures
  attainment at a few rates; walking them from the lowest, the goodput lies between the last rate
  that passes and the first that fails, and is interpolated linearly there (`interpolated`). A
  rate that passes again after a failure (noise, or a non-monotone service) does not count: the
  report flags it (`non_monotone`). When every rate passes, the goodput is at least the highest
  one (`all_pass`, a lower bound); when the lowest fails, it is below the sweep (`none_pass`, 0).
  `measured` is always the highest measured rate below the first failure (None when none passes).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from bench.serve_load import Result


def tpot(r: Result) -> float | None:
    """Mean inter-token latency of a request (seconds); None with fewer than two tokens."""
    return sum(r.itl) / len(r.itl) if r.itl else None


def attains(r: Result, slo_ttft_s: float, slo_tpot_s: float) -> bool:
    t = tpot(r)
    return r.ok and r.tokens > 0 and r.ttft <= slo_ttft_s and (t is None or t <= slo_tpot_s)


def attainment(results: Sequence[Result], slo_ttft_s: float, slo_tpot_s: float) -> float:
    """The share of `results` (every request sent) that attained both SLOs; nan without requests."""
    if not results:
        return math.nan
    return sum(attains(r, slo_ttft_s, slo_tpot_s) for r in results) / len(results)


@dataclass(frozen=True)
class Goodput:
    rate: float  # requests/s (interpolated, or the bound the method names)
    method: str  # interpolated | all_pass | none_pass | no_rates
    measured: float | None  # the highest measured rate below the first failing one
    non_monotone: bool  # a rate above the first failing one passes again

    def as_dict(self) -> dict[str, Any]:
        return {"goodput_rate": round(self.rate, 3), "goodput_method": self.method,
                "goodput_rate_measured": self.measured, "non_monotone": self.non_monotone}


def goodput(points: Sequence[tuple[float, float]], target: float = 0.9) -> Goodput:
    """The goodput of a sweep of (rate, attainment) points (finite rates only; any order)."""
    pts = sorted((r, a) for r, a in points if math.isfinite(r) and not math.isnan(a))
    if not pts:
        return Goodput(0.0, "no_rates", None, False)
    fail = next((i for i, (_, a) in enumerate(pts) if a < target), None)
    if fail is None:
        return Goodput(pts[-1][0], "all_pass", pts[-1][0], False)
    non_monotone = any(a >= target for _, a in pts[fail + 1:])
    if fail == 0:
        return Goodput(0.0, "none_pass", None, non_monotone)
    (r0, a0), (r1, a1) = pts[fail - 1], pts[fail]
    rate = r0 + (a0 - target) / (a0 - a1) * (r1 - r0)  # a0 >= target > a1: a0 - a1 > 0
    return Goodput(rate, "interpolated", r0, non_monotone)


def goodput_grid(runs: Sequence[dict[str, Any]], target: float = 0.9) -> dict[str, dict[str, Any]]:
    """Per extra TPOT SLO (a run's `attainment_by_tpot_ms` keys), the sweep's goodput there."""
    slos = sorted({t for r in runs for t in r.get("attainment_by_tpot_ms", {})}, key=float)
    return {t: goodput([(r["request_rate"], r["attainment_by_tpot_ms"][t]) for r in runs], target).as_dict()
            for t in slos}


def ratio(a: float, b: float) -> float | None:
    """a / b for the report; None where it means nothing (b = 0)."""
    return round(a / b, 3) if b > 0 else None


# ---- layouts -------------------------------------------------------------------------------------
LAYOUT_KEYS = {"prefill": "prefill", "decode": "decode", "colocated": "colocated", "tp": "prefill_tp"}


@dataclass(frozen=True)
class Layout:
    """One service layout of a comparison: `prefill=1,decode=3`, `colocated=2`, `prefill=1,decode=1,tp=2`;
    other dotted keys are config overrides of that layout only (`colocated.max_num_batched_tokens=256`)."""

    name: str
    flags: dict[str, int]  # `pdserve up` flags: prefill, decode, colocated, prefill_tp (and decode_tp)
    overrides: tuple[str, ...]  # KEY=VALUE, as --set

    @property
    def disaggregated(self) -> bool:
        return not self.flags.get("colocated")


def parse_layout(text: str) -> Layout:
    flags: dict[str, int] = {}
    overrides, name = [], ""
    for part in (p.strip() for p in text.split(",") if p.strip()):
        key, sep, value = part.partition("=")
        if not sep or not value:
            raise ValueError(f"--layout {text!r}: {part!r} is not KEY=VALUE")
        if key == "name":
            name = value
        elif "." in key:
            overrides.append(part)
        elif key in LAYOUT_KEYS:
            if not value.isdigit() or int(value) < (0 if key != "tp" else 1):
                raise ValueError(f"--layout {text!r}: {key} must be a whole number")
            flags[LAYOUT_KEYS[key]] = int(value)
        else:
            raise ValueError(f"--layout {text!r}: unknown key {key!r} (prefill, decode, colocated, tp, name, "
                             "or a dotted config key)")
    if "prefill_tp" in flags:
        flags["decode_tp"] = flags["prefill_tp"]
    colocated, pd = flags.get("colocated", 0), flags.get("prefill", 0) + flags.get("decode", 0)
    if bool(colocated) == bool(pd) or (pd and not (flags.get("prefill") and flags.get("decode"))):
        raise ValueError(f"--layout {text!r}: give prefill=P,decode=D (both >= 1) or colocated=N")
    if colocated and flags.get("prefill_tp", 1) > 1:
        raise ValueError(f"--layout {text!r}: tp applies to prefill and decode nodes")
    if not name:
        tp = flags.get("prefill_tp", 1)
        name = f"colocated{colocated}" if colocated else f"{flags['prefill']}P{flags['decode']}D" + (
            f"-tp{tp}" if tp > 1 else "")
    return Layout(name, flags, tuple(overrides))


# ---- the comparison's table and plot --------------------------------------------------------------
def comparison(layouts: list[dict[str, Any]]) -> dict[str, Any]:
    """The best disaggregated layout's goodput over the best colocated one's (None without both)."""
    best = {}
    for kind in (True, False):
        rates = [lay["goodput_rate"] for lay in layouts if lay["disaggregated"] is kind]
        best[kind] = max(rates) if rates else None
    pd, colo = best[True], best[False]
    out: dict[str, Any] = {
        "goodput_ratio_pd_over_colocated": ratio(pd, colo) if pd is not None and colo is not None else None}
    grid = sorted({t for lay in layouts for t in lay.get("goodput_by_tpot_ms", {})}, key=float)
    if grid:  # the same comparison at each extra TPOT SLO
        out["goodput_ratio_by_tpot_ms"] = {t: _grid_ratio(layouts, t) for t in grid}
    return out


def _grid_ratio(layouts: list[dict[str, Any]], slo: str) -> float | None:
    best = {}
    for kind in (True, False):
        rates = [lay["goodput_by_tpot_ms"][slo]["goodput_rate"] for lay in layouts
                 if lay["disaggregated"] is kind and slo in lay.get("goodput_by_tpot_ms", {})]
        best[kind] = max(rates) if rates else None
    pd, colo = best[True], best[False]
    return ratio(pd, colo) if pd is not None and colo is not None else None


def table(report: dict[str, Any]) -> str:
    """The layouts' runs as a text table (milliseconds; KV: the KV transfers' p50 and p99), then
    each layout's goodput."""
    head = ("layout", "rate", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99", "ITL p99", "KV p50", "KV p99",
            "tok/s", "attain")
    rows = [head]
    for lay in report["layouts"]:
        for r in lay["runs"]:
            server = r.get("server") or {}
            kv = (f"{server[k]:.2f}" if k in server else "-" for k in ("kv_transfer_p50_ms", "kv_transfer_p99_ms"))
            rows.append((lay["name"], f"{r['request_rate']:g}", *(f"{r[k][p]:.1f}" for k, p in (
                ("ttft", "p50_ms"), ("ttft", "p99_ms"), ("tpot", "p50_ms"), ("tpot", "p99_ms"), ("itl", "p99_ms"))),
                *kv, f"{r['output_throughput']:.0f}", f"{r['slo_attainment']:.2f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    lines.append(f"SLOs: TTFT <= {report['slo_ttft_ms']:g} ms, TPOT <= {report['slo_tpot_ms']:g} ms; "
                 f"goodput: highest rate with attainment >= {report['goodput_attainment']:g}")
    for lay in report["layouts"]:
        lines.append(f"{lay['name']} ({lay['gpus']:g} GPUs): goodput {lay['goodput_rate']:g} req/s "
                     f"({lay['goodput_method']}" + (", non-monotone" if lay["non_monotone"] else "") + ")")
    if report.get("goodput_ratio_pd_over_colocated") is not None:
        lines.append(f"PD / colocated goodput: {report['goodput_ratio_pd_over_colocated']:g}")
    for slo, pd_over in report.get("goodput_ratio_by_tpot_ms", {}).items():
        each = ", ".join(f"{lay['name']} {lay['goodput_by_tpot_ms'][slo]['goodput_rate']:g}"
                         for lay in report["layouts"] if slo in lay.get("goodput_by_tpot_ms", {}))
        lines.append(f"TPOT <= {slo} ms: goodput {each} req/s; PD / colocated "
                     + (f"{pd_over:g}" if pd_over is not None else "-"))
    return "\n".join(lines)


def plot_attainment(report: dict[str, Any], path: Any) -> None:
    """One figure: every layout's attainment against request rate, the target dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    for lay in report["layouts"]:
        runs = sorted((r for r in lay["runs"] if math.isfinite(r["request_rate"])), key=lambda r: r["request_rate"])
        ax.plot([r["request_rate"] for r in runs], [100 * r["slo_attainment"] for r in runs], "o-",
                label=f"{lay['name']} (goodput {lay['goodput_rate']:g})")
    ax.axhline(100 * report["goodput_attainment"], ls="--", c="gray", lw=0.8)
    ax.set(title=f"SLO attainment (TTFT <= {report['slo_ttft_ms']:g} ms, TPOT <= {report['slo_tpot_ms']:g} ms)",
           xlabel="request rate (req/s)", ylabel="attainment (%)", ylim=(0, 105))
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
