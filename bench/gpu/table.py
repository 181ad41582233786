"""The tables bench/gpu/run.sh prints last, from the JSON its stages write.

    python bench/gpu/table.py engine FILE.jsonl       `bench engine` lines
    python bench/gpu/table.py prefill FILE.jsonl      `bench prefill` lines
    python bench/gpu/table.py acceptance FILE.jsonl   `bench acceptance --json` lines
    python bench/gpu/table.py kv FILE.jsonl           `python -m bench.kv --json` lines
    python bench/gpu/table.py serve REPORT.json...    `bench serve --json` reports, a row per rate
    python bench/gpu/table.py ttft REPORT.json...     the same reports' TTFT parts (router means, ms)
    python bench/gpu/table.py ttft-p99 REPORT.json... the same parts' p99 (ms), beside the client's

Each `bench engine` process prints its engine rows (one per k), then the weight-read floor, then
(with --hf) Hugging Face generate; the floor and HF figures belong to the engine rows before them.
"x k=0": a k > 0 row's step time over the k = 0 row of the same process and batch. With
--spec-k-policy adaptive the mode says "adaptive" and k the share of steps it ran plain ("3, 0: 80%"):
compare tok/s with the k = 0 row then, as its steps differ in length.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _lines(path: str) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.startswith("{")]


def _fmt(value: object, digits: int = 3) -> str:
    if value is None or value == "":
        return "-"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def engine(path: str) -> list[list[str]]:
    lines, out, pending = _lines(path), [], []
    for i, d in enumerate(lines):
        if "ms_per_step" in d:
            base = [e for e in pending if e["spec_tokens"] == 0 and e["batch"] == d["batch"]]
            d["x_k0"] = f"{d['ms_per_step'] / base[-1]['ms_per_step']:.2f}x" if base and d["spec_tokens"] else ""
            pending.append(d)
        elif "floor_ms_per_step" in d:
            after = lines[i + 1] if i + 1 < len(lines) else {}
            for e in pending:
                e["floor"], e["hf"] = d["floor_ms_per_step"], after.get("hf_generate_ms_per_step")
            out += pending
            pending = []
    rows = [["model", "batch", "mode", "k", "ms/step", "x k=0", "tok/s", "floor ms", "x floor", "gpu busy", "HF ms/step"]]
    for e in out + pending:
        mode = ("graph" if e.get("graphs") else "eager") + (" det" if e.get("deterministic") else "")
        mode += f" dv{e['draft_vocab']}" if e.get("draft_vocab") else ""
        mode += f" tp{e['tp']} {e['all_reduce']}" if e.get("tp", 1) > 1 else ""
        mode += " adaptive" if e.get("spec_k_policy") == "adaptive" else ""
        k = str(e["spec_tokens"])
        k += f", 0: {e['k_share'].get('0', 0):.0%}" if e.get("spec_k_policy") == "adaptive" else ""
        floor = e.get("floor")
        rows.append([e["model"], str(e["batch"]), mode, k, f"{e['ms_per_step']:.3f}", e["x_k0"],
                     f"{e['tokens_per_s']:.0f}", _fmt(floor, 4), f"{e['ms_per_step'] / floor:.2f}" if floor else "-",
                     _fmt(e.get("gpu_busy")), _fmt(e.get("hf"))])
    return rows


def prefill(path: str) -> list[list[str]]:
    rows = [["model", "B x N", "k", "draft vocab", "TTFT ms", "with drafts ms", "HF ms", "floor ms", "x floor"]]
    for r in _lines(path):
        floor = r.get("floor_ms")
        rows.append([r["model"], f"{r['batch']} x {r['prompt']}", str(r["spec_tokens"]), _fmt(r.get("draft_vocab")),
                     _fmt(r["ttft_ms"]), _fmt(r.get("step_ms")), _fmt(r.get("hf_ms")), _fmt(floor, 4),
                     f"{r['ttft_ms'] / floor:.2f}" if floor else "-"])
    return rows


def acceptance(path: str) -> list[list[str]]:
    rows = [["model", "k", "draft vocab", "accepted/step", "tok/s MTP", "tok/s plain", "speedup", "decode speedup",
             "same tokens"]]
    for r in _lines(path):
        rows.append([r["model"], str(r["spec_tokens"]), _fmt(r.get("draft_vocab") or None),
                     _fmt(r["mean_accepted_per_step"], 2), _fmt(r["tokens_per_s_mtp"], 1), _fmt(r["tokens_per_s_plain"], 1),
                     _fmt(r["speedup"]), _fmt(r["decode_speedup"]), str(r["same_tokens_as_plain"])])
    return rows


def kv(path: str) -> list[list[str]]:
    rows = [["backend", "device", "MiB", "layers x planes x blocks x bytes", "ms", "GB/s", "floor GB/s", "x floor",
             "d2d GB/s", "intact"]]
    for r in _lines(path):
        shape = f"{r['layers']} x {r.get('planes', 1)} x {r['blocks']} x {r['block_bytes']}"
        rows.append([r["backend"], r["device"], f"{r['bytes'] / 2**20:.0f}", shape, _fmt(r["seconds"] * 1e3, 3),
                     _fmt(r["gbps"], 2), _fmt(r["raw_gbps"], 2),
                     _fmt(r["ratio"], 2), _fmt(r.get("d2d_gbps"), 2), str(r["intact"])])
    return rows


def serve(*paths: str) -> list[list[str]]:
    rows = [["run", "rate", "done", "failed", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms", "out tok/s",
             "goodput"]]
    for path in paths:
        for r in json.loads(Path(path).read_text())["runs"]:
            t, i = r["ttft"], r["itl"]
            rows.append([Path(path).stem, str(r["request_rate"]), str(r["completed"]), str(r["failed"]),
                         _fmt(t["p50_ms"]), _fmt(t["p99_ms"]), _fmt(i["p50_ms"]), _fmt(i["p99_ms"]),
                         f"{r['output_throughput']:.0f}", _fmt(r["goodput"])])
    return rows


TTFT_PARTS = ("parse", "tokenize", "queue", "reserve", "prefill_queue", "prefill", "return", "write")


def ttft(*paths: str) -> list[list[str]]:
    """Each run's TTFT by its parts: the router's means (router/ttft.py) beside the client's p50,
    and the steps that met a shape with no graph yet (cold)."""
    rows = [["run", "rate", "client p50", "router mean", *TTFT_PARTS, "prefill on node", "KV", "cold"]]
    for path in paths:
        for r in json.loads(Path(path).read_text())["runs"]:
            s = r.get("server", {})
            rows.append([Path(path).stem, str(r["request_rate"]), _fmt(r["ttft"]["p50_ms"]),
                         _fmt(s.get("router_ttft_mean_ms")),
                         *(_fmt(s.get(f"ttft_{part}_mean_ms"), 3) for part in TTFT_PARTS),
                         _fmt(s.get("prefill_ms_per_request")), _fmt(s.get("kv_transfer_ms_per_request")),
                         _fmt(s.get("cold_shape_steps"), 0)])
    return rows


def ttft_p99(*paths: str) -> list[list[str]]:
    """Each run's TTFT tail by its parts: each part's p99 (from the router's histograms) beside the
    client's p99, to tell which part the slow first tokens waited in."""
    rows = [["run", "rate", "client p99", *TTFT_PARTS]]
    for path in paths:
        for r in json.loads(Path(path).read_text())["runs"]:
            s = r.get("server", {})
            rows.append([Path(path).stem, str(r["request_rate"]), _fmt(r["ttft"].get("p99_ms")),
                         *(_fmt(s.get(f"ttft_{part}_p99_ms"), 3) for part in TTFT_PARTS)])
    return rows


KINDS = {"engine": engine, "prefill": prefill, "acceptance": acceptance, "kv": kv, "serve": serve, "ttft": ttft,
         "ttft-p99": ttft_p99}


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] not in KINDS:
        print(__doc__, file=sys.stderr)
        return 2
    paths = [p for p in argv[1:] if Path(p).is_file()]
    if not paths:
        print(f"no {argv[0]} results ({' '.join(argv[1:])})")
        return 1
    table = KINDS[argv[0]](*paths)
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    for r in table:
        print(" | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
