"""`pdserve bench acceptance`: how many MTP drafts the target accepts, on held-out prompts.

The command line and the printed report; the measurement (what is counted, and why) is
mtp/acceptance.py.
"""

from __future__ import annotations

import argparse
import json

from engine.model.loader import load_model
from engine.model.paths import default_model
from mtp.acceptance import measure
from mtp.prompts import HELDOUT_PROMPTS


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="tiny, smollm2 (default when installed), a path")
    p.add_argument("--spec-tokens", type=int, default=3, help="k, draft tokens per step")
    p.add_argument("--draft-vocab", type=int, default=0, metavar="N",
                   help="drafts score the model's N most frequent tokens (FR-Spec); 0 = all")
    p.add_argument("--prompts", default=str(HELDOUT_PROMPTS), help="one prompt per line ('#' comments)")
    p.add_argument("--num-prompts", type=int, default=None, help="use the first N prompts")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--batch", type=int, default=1, help="requests decoded together")
    p.add_argument("--mtp", default=None, help="an MTP safetensors file (default: the shipped head)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    loaded = load_model(args.model or default_model(), device=args.device, dtype=args.dtype, mtp_path=args.mtp)
    result = measure(loaded, args)
    if args.json:
        print(json.dumps(result), flush=True)
        return 0
    r = result
    vocab = f"draft vocabulary {r['draft_vocab']}" if r["draft_vocab"] else "full draft vocabulary"
    print(f"{r['model']} ({'trained' if r['mtp_trained'] else 'untrained'} MTP head), {r['device']} {r['dtype']}, "
          f"k={r['spec_tokens']}, {vocab}, temperature {r['temperature']}, {r['prompts']} prompts from {r['prompts_file']}")
    print(f"  mean accepted tokens per step (bonus included): {r['mean_accepted_per_step']:.2f} "
          f"over {r['decode_steps']} steps")
    for j, rate in enumerate(r["acceptance_by_position"], start=1):
        print(f"  draft {j}: {100 * rate:.1f}% accepted")
    print(f"  tokens/s: {r['tokens_per_s_mtp']:.1f} with MTP, {r['tokens_per_s_plain']:.1f} without "
          f"({r['speedup']}x); same tokens as without MTP: {r['same_tokens_as_plain']}")
    print(f"  decode tokens/s (after the first token): {r['decode_tokens_per_s_mtp']:.1f} with MTP, "
          f"{r['decode_tokens_per_s_plain']:.1f} without ({r['decode_speedup']}x)")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m bench.acceptance")
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
