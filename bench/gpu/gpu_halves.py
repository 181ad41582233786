"""Constrained decode steps in two halves around the host's masks, against reading the previous
step first (issue 28; engine/decode_batch.py, PDSERVE_MASK_OVERLAP). One process, one engine per k:
the 50 schemas of bench/structured_schemas.json (json_schema, greedy) at batch `--batch`, the
modes in turn (read-first, halves; `--rounds` times) after a warm-up pass in each (schemas compiled, graphs
captured), so the timed passes hold decode steps and the host's mask work only.

    python bench/gpu/gpu_halves.py --model smollm2 --device cuda [--batch 32] [--max-tokens 256]

Prints one JSON line per pass, then a table: wall seconds, output tokens/s, engine steps, decode
steps a request (summed), tokens per request-step, and whether the tokens equal the first pass's.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import engine.decode_batch as decode_batch
from engine.engine import EngineConfig, LLMEngine
from engine.loader import load_model
from engine.sampling_params import SamplingParams
from engine.structured import StructuredSpec
from mtp.prompts import chat_ids

SCHEMAS = Path(__file__).resolve().parents[1] / "structured_schemas.json"


def one_pass(eng: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]) -> dict:
    start, steps = time.perf_counter(), 0
    ids = [eng.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    while eng.has_unfinished():
        eng.step()
        steps += 1
    seconds = time.perf_counter() - start
    reqs = [eng.requests[i] for i in ids]
    tokens = sum(len(r.output_ids) for r in reqs)
    request_steps = sum(r.steps for r in reqs)
    return {"seconds": round(seconds, 3), "tokens": tokens, "tokens_per_s": round(tokens / seconds, 1),
            "engine_steps": steps, "request_steps": request_steps,
            "tokens_per_request_step": round((tokens - len(reqs)) / max(request_steps, 1), 3),
            "outputs": [r.output_ids for r in reqs]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--ks", default="0,3")
    ap.add_argument("--rounds", type=int, default=3, help="timed passes per mode, alternating")
    args = ap.parse_args()
    loaded = load_model(args.model, device=args.device, dtype=args.dtype)
    items = json.loads(SCHEMAS.read_text())
    prompts = [chat_ids(loaded.tokenizer, it["prompt"]) for it in items]
    params = [SamplingParams(max_tokens=args.max_tokens, structured=StructuredSpec.json_schema(it["schema"]))
              for it in items]
    longest = max(len(p) for p in prompts) + args.max_tokens + 8
    rows = []
    for k in (int(x) for x in args.ks.split(",")):
        eng = LLMEngine(loaded, EngineConfig(num_speculative_tokens=k, device=args.device, max_num_seqs=args.batch,
                                             max_model_len=longest))
        for halves in (False, True):  # warm-up: compiles, captures both modes' graphs
            decode_batch.HALVES = halves
            one_pass(eng, prompts, params)
        first = None
        for halves in (False, True) * args.rounds:
            decode_batch.HALVES = halves
            r = one_pass(eng, prompts, params)
            first = first or r["outputs"]
            row = {"k": k, "halves": halves, **{a: b for a, b in r.items() if a != "outputs"},
                   "same_tokens_as_first": r["outputs"] == first}
            print(json.dumps(row), flush=True)
            rows.append(row)
    print("| k | mode | s (median) | tok/s (median) | engine steps | request steps | tokens / request-step | same tokens |")
    print("|---|---|---|---|---|---|---|---|")
    for k in sorted({r["k"] for r in rows}):
        for halves in (False, True):
            mine = [r for r in rows if r["k"] == k and r["halves"] == halves]
            mid = sorted(mine, key=lambda r: r["seconds"])[len(mine) // 2]
            print(f"| {k} | {'halves' if halves else 'read-first'} | {mid['seconds']} "
                  f"({', '.join(str(r['seconds']) for r in mine)}) | {mid['tokens_per_s']} | {mid['engine_steps']} | "
                  f"{mid['request_steps']} | {mid['tokens_per_request_step']} | "
                  f"{all(r['same_tokens_as_first'] for r in mine)} |")

if __name__ == "__main__":
    main()
