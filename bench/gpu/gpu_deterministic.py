"""Exact greedy in bf16 on the GPU (issue 20): the same prompts decoded greedily alone (k=0 and
k=3) and inside batches of 16 and 64 (k=0 and k=3), with and without `--deterministic`, token for
token against the k=0 batch-1 run and against k=0 in the same batch (what MTP alone changes);
plus the mode's cost in decode time per token.

    python bench/gpu/gpu_deterministic.py --model /tmp/smollm2.gguf \
        --mtp engine/model/mtp_heads/smollm2.safetensors --num-prompts 16 --max-tokens 96

The batch-64 run fills the batch with 48 other prompts (random token ids) decoding beside the
16 under test. Prints one JSON line per (mode, run) and a table last.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from engine.engine import EngineConfig, LLMEngine
from engine.model.loader import load_model
from engine.sampling.sampling_params import SamplingParams
from mtp.prompts import HELDOUT_PROMPTS, chat_ids, read_prompts

RUNS = [("k0-b1", 0, 1), ("k3-b1", 3, 1), ("k0-b16", 0, 16), ("k3-b16", 3, 16), ("k0-b64", 0, 64), ("k3-b64", 3, 64)]


def decode(loaded, prompts: list[list[int]], k: int, batch: int, deterministic: bool, max_tokens: int):
    device = str(next(loaded.model.parameters()).device)
    longest = max(len(p) for p in prompts) + max_tokens + 8
    engine = LLMEngine(loaded, EngineConfig(num_speculative_tokens=k, device=device, max_num_seqs=batch,
                                            max_model_len=longest, deterministic=deterministic))
    engine.generate(prompts[:1], SamplingParams(max_tokens=4))  # warm-up (graphs, kernels)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    sync(device)
    start = time.perf_counter()
    reqs = engine.generate(prompts, params)
    sync(device)
    return [r.output_ids for r in reqs], time.perf_counter() - start


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def fillers(vocab: int, n: int, length: int = 40) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (length,), generator=g).tolist() for _ in range(n)]


def run_mode(loaded, prompts: list[list[int]], deterministic: bool, max_tokens: int,
             runs: list[str]) -> dict[str, dict]:
    extra = fillers(loaded.model.config.vocab_size, 64 - len(prompts))
    out: dict[str, dict] = {}
    for name, k, batch in (run for run in RUNS if run[0] in runs):
        batch_prompts = prompts + extra if batch == 64 else prompts
        ids, seconds = decode(loaded, batch_prompts, k, batch, deterministic, max_tokens)
        ids = ids[: len(prompts)]
        base = out["k0-b1"]["ids"] if out else ids
        plain = out.get(f"k0-b{batch}", {"ids": ids})["ids"]  # k = 0 in the same batch
        same = sum(a == b for a, b in zip(ids, base, strict=True))
        same_k0 = sum(a == b for a, b in zip(ids, plain, strict=True))
        out[name] = {"ids": ids, "same": same, "same_k0": same_k0, "seconds": round(seconds, 3)}
        print(json.dumps({"deterministic": deterministic, "run": name, "same_as_k0_b1": f"{same}/{len(prompts)}",
                          "same_as_k0_same_batch": f"{same_k0}/{len(prompts)}", "seconds": round(seconds, 3)}),
              flush=True)
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--mtp", default=None)
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--modes", default="default,deterministic", help="the kernel modes to run, comma-separated")
    p.add_argument("--runs", default=",".join(r[0] for r in RUNS),
                   help="the runs, comma-separated, k0-b1 first (what the others are compared with)")
    args = p.parse_args()
    loaded = load_model(args.model, device=args.device, dtype=args.dtype, mtp_path=args.mtp)
    prompts = [chat_ids(loaded.tokenizer, t) for t in read_prompts(HELDOUT_PROMPTS)[: args.num_prompts]]
    with torch.no_grad():
        dets = [m == "deterministic" for m in args.modes.split(",")]
        modes = {det: run_mode(loaded, prompts, det, args.max_tokens, args.runs.split(",")) for det in dets}
    n = len(prompts)
    print(f"\n{'run':8} | default: as k0-b1 | as k0, same batch | deterministic: as k0-b1 | default s | "
          "deterministic s | cost")
    for name in args.runs.split(","):
        a, b = modes.get(False, modes.get(True)), modes.get(True, modes.get(False))
        a, b = a[name], b[name]
        print(f"{name:8} | {a['same']:>8}/{n:<8} | {a['same_k0']:>8}/{n:<8} | {b['same']:>12}/{n:<10} | "
              f"{a['seconds']:9.3f} | {b['seconds']:15.3f} | {b['seconds'] / a['seconds']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
