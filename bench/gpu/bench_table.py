"""One table from `pdserve bench engine` JSON lines (bench/gpu/gpu_speed.sh writes them).

Each bench process prints its engine rows (one per k), then the copy floor, then (with --hf)
Hugging Face generate; the floor and HF figures apply to the engine rows before them. "x k=0":
a k > 0 row's step time over the k = 0 row of the same process and batch.
Usage: python bench/gpu/bench_table.py bench.jsonl
"""

from __future__ import annotations

import json
import sys


def rows(lines: list[dict]) -> list[list[str]]:
    out, pending = [], []
    for i, d in enumerate(lines):
        if "ms_per_step" in d:
            base = [e for e in pending if e["spec_tokens"] == 0 and e["batch"] == d["batch"]]
            d["x_k0"] = f"{d['ms_per_step'] / base[-1]['ms_per_step']:.2f}x" if base and d["spec_tokens"] else ""
            pending.append(d)
        elif "floor_ms_per_step" in d:
            after = lines[i + 1] if i + 1 < len(lines) else {}
            for e in pending:
                e["floor"], e["hf"] = d["floor_ms_per_step"], after.get("hf_generate_ms_per_step", "")
            out += [_row(e) for e in pending]
            pending = []
    return out + [_row(e) for e in pending]


def _row(e: dict) -> list[str]:
    mode = ("graph" if e.get("graphs") else "eager") + (" det" if e.get("deterministic") else "")
    mode += f" dv{e['draft_vocab']}" if e.get("draft_vocab") else ""
    mode += " pdl" if e.get("pdl") else ""
    mode += f" tp{e['tp']} {e['all_reduce']}" if e.get("tp", 1) > 1 else ""
    return [e["model"], str(e["batch"]), mode, str(e["spec_tokens"]),
            f"{e['ms_per_step']:.3f}", e.get("x_k0", ""), f"{e['tokens_per_s']:.0f}", str(e.get("kernels_per_step", "")),
            str(e.get("copies_per_step", "")), str(e.get("torch_kernels_per_step", "")), str(e.get("gpu_busy", "")), str(e.get("all_reduce_us_per_step", "")),
            str(e.get("floor", "")), str(e.get("hf", ""))]


def main(path: str) -> None:
    lines = []
    for line in open(path):
        line = line.strip()
        if line.startswith("{"):
            lines.append(json.loads(line))
    head = ["model", "batch", "mode", "k", "ms/step", "x k=0", "tok/s", "kernels/step", "copies/step", "torch kernels/step",
            "gpu busy", "coll us/step", "floor ms", "HF ms/step"]
    table = [head] + rows(lines)
    widths = [max(len(r[i]) for r in table) for i in range(len(head))]
    for r in table:
        print(" | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)))


if __name__ == "__main__":
    main(sys.argv[1])
