"""`pdserve bench structured --model ...`: the in-process half (bench/structured.py is the command
line, the HTTP half and the report).

Runs the single-process engine four times over the same chat-templated prompts: with k draft
tokens and with none, each with every prompt's schema as its `SamplingParams.structured` and
without. Engine runs and step counting are mtp/acceptance.py's (`run_engine`: each request's
last step left out, since a stop or the length limit cuts it short). Reports per run the
outputs' texts and token counts (bench/structured.py scores them), and for the k runs the MTP acceptance, accepted drafts / proposed
(= sum over full steps of (tokens emitted - 1) / (k x steps)), its share per draft position, and
whether the outputs equal the k = 0 run's token for token (they must when greedy).
"""

from __future__ import annotations

import argparse
from typing import Any

from engine.grammar.structured import StructuredSpec
from engine.model.loader import LoadedModel, load_model
from engine.sampling.sampling_params import SamplingParams
from mtp.acceptance import RunStats, by_position, run_engine
from mtp.prompts import chat_ids


def run_local(args: argparse.Namespace, items: list[dict]) -> dict[str, Any]:
    if args.spec_tokens <= 0:
        raise ValueError("--spec-tokens must be >= 1 (compared with k = 0)")
    loaded = load_model(args.model, device=args.device, dtype=args.dtype)
    prompts = [chat_ids(loaded.tokenizer, item["prompt"]) for item in items]
    runs: dict[str, dict] = {}
    for constrained in (True, False):
        params = [SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed + i,
                                 structured=StructuredSpec.json_schema(item["schema"]) if constrained else None)
                  for i, item in enumerate(items)]
        engine_args = argparse.Namespace(max_tokens=args.max_tokens, draft_vocab=0, device=args.device,
                                         batch=args.batch)
        plain = run_engine(loaded, 0, prompts, params, engine_args)
        mtp = run_engine(loaded, args.spec_tokens, prompts, params, engine_args)
        what = "json_schema" if constrained else "free"
        runs[f"k=0 {what}"] = _row(loaded, plain)
        runs[f"k={args.spec_tokens} {what}"] = {**_row(loaded, mtp), **_acceptance(mtp, args.spec_tokens),
                                                "same_tokens_as_k0": mtp.outputs == plain.outputs}
    return {"model": loaded.name, "device": args.device, "spec_tokens": args.spec_tokens, "runs": runs}


def _row(loaded: LoadedModel, stats: RunStats) -> dict[str, Any]:
    return {"texts": [loaded.tokenizer.decode(out) for out in stats.outputs],
            "tokens": [len(out) for out in stats.outputs], "seconds": round(stats.seconds, 2)}


def _acceptance(stats: RunStats, k: int) -> dict[str, Any]:
    steps = len(stats.step_counts)
    accepted = sum(c - 1 for c in stats.step_counts)
    return {"acceptance": round(accepted / (k * steps), 4) if steps else None, "decode_steps": steps,
            "acceptance_by_position": [round(r, 4) for r in by_position(stats.step_counts, k)]}
