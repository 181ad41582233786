"""How many MTP drafts the target accepts, on held-out prompts (`pdserve bench acceptance`,
whose command line is bench/acceptance.py).

Runs the single-process engine twice over the same chat-templated prompts (default:
mtp/prompt_lists/heldout_prompts.txt, never used in training): with k drafts per step and
without MTP. Reports, from the decode steps that were not cut short by a stop or the length
limit (each request's last step is left out):
  * acceptance_by_position[j-1]: the share of steps whose drafts 1..j were all accepted;
  * mean_accepted_per_step: tokens emitted per step, the bonus token included
    (= 1 + the sum of acceptance_by_position);
and the wall-clock tokens/s of both runs (prefill included, after a warm-up), their decode
tokens/s (each request's tokens after its first over the time from its first token to its
last: prefill and time to first token left out, as an inter-token latency), and whether both
runs gave the same tokens (they must when greedy). `--draft-vocab N` drafts over the model's N
most frequent tokens (FR-Spec, engine/spec_decode/draft_vocab.py); the plain run is the same either way, and
`draft_vocab_coverage` is the share of its tokens inside those N.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.engine import EngineConfig, LLMEngine
from engine.model.loader import LoadedModel
from engine.sampling.sampling_params import SamplingParams
from engine.spec_decode.draft_vocab import read_ranking
from mtp.prompts import chat_ids, read_prompts


@dataclass
class RunStats:
    tokens: int  # generated tokens, first tokens included
    seconds: float
    step_counts: list[int]  # tokens emitted by each full decode step
    outputs: list[list[int]]  # each request's tokens
    decode_seconds: float = 0.0  # summed over requests: from its first token to its last

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens after the first per second of decoding (prefill and first token left out)."""
        after_first = sum(max(len(o) - 1, 0) for o in self.outputs)
        return after_first / self.decode_seconds if self.decode_seconds else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def run_engine(loaded: LoadedModel, k: int, prompts: list[list[int]], params: list[SamplingParams],
               args: argparse.Namespace) -> RunStats:
    longest = max(len(p) for p in prompts) + args.max_tokens + 8
    engine = LLMEngine(loaded, EngineConfig(num_speculative_tokens=k, draft_vocab_size=args.draft_vocab if k else 0,
                                            device=args.device, max_num_seqs=args.batch, max_model_len=longest))
    engine.generate(prompts[:1], SamplingParams(max_tokens=4))  # warm-up
    start = time.perf_counter()
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    first: dict[str, float] = {}
    decode_seconds = 0.0
    counts: list[int] = []
    while engine.has_unfinished():
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            if out.request_id in first and out.finish_reason is None:
                counts.append(len(out.new_token_ids))
            first.setdefault(out.request_id, now)
            if out.finish_reason is not None:
                decode_seconds += now - first[out.request_id]
    seconds = time.perf_counter() - start
    outputs = [engine.requests[i].output_ids for i in ids]
    return RunStats(sum(len(o) for o in outputs), seconds, counts, outputs, decode_seconds)


def by_position(counts: list[int], k: int) -> list[float]:
    """Share of steps whose first j drafts were all accepted, j = 1..k."""
    if not counts:
        return [0.0] * k
    return [sum(c > j for c in counts) / len(counts) for j in range(1, k + 1)]


def draft_vocab_coverage(loaded: LoadedModel, size: int, outputs: list[list[int]]) -> float | None:
    """Share of `outputs`' tokens inside the draft vocabulary of `size` (None: full vocabulary).
    A draft can only be accepted where the target's token is inside."""
    vocab = loaded.model.config.vocab_size
    if not 0 < size < vocab or loaded.vocab_rank_path is None:
        return None
    tokens = torch.tensor([t for out in outputs for t in out], dtype=torch.int64)
    inside = torch.isin(tokens, read_ranking(loaded.vocab_rank_path, vocab)[:size])
    return round(float(inside.float().mean()), 4) if tokens.numel() else None


def measure(loaded: LoadedModel, args: argparse.Namespace) -> dict:
    if args.spec_tokens <= 0:
        raise ValueError("--spec-tokens must be >= 1")
    texts = read_prompts(args.prompts)[: args.num_prompts]
    if not texts:
        raise ValueError(f"no prompts in {args.prompts}")
    prompts = [chat_ids(loaded.tokenizer, t) for t in texts]
    params = [SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed + i)
              for i in range(len(prompts))]
    mtp = run_engine(loaded, args.spec_tokens, prompts, params, args)
    plain = run_engine(loaded, 0, prompts, params, args)
    rates = by_position(mtp.step_counts, args.spec_tokens)
    return {
        "model": loaded.name, "mtp_trained": loaded.mtp_trained, "device": args.device,
        "dtype": str(next(loaded.model.parameters()).dtype).removeprefix("torch."),
        "spec_tokens": args.spec_tokens, "draft_vocab": args.draft_vocab or None,
        "draft_vocab_coverage": draft_vocab_coverage(loaded, args.draft_vocab, plain.outputs),
        "temperature": args.temperature, "prompts": len(prompts),
        "prompts_file": Path(args.prompts).name, "max_tokens": args.max_tokens, "batch": args.batch,
        "decode_steps": len(mtp.step_counts),
        "mean_accepted_per_step": round(1.0 + sum(rates), 4),
        "acceptance_by_position": [round(r, 4) for r in rates],
        "tokens_mtp": mtp.tokens, "same_tokens_as_plain": mtp.outputs == plain.outputs,
        "tokens_per_s_mtp": round(mtp.tokens_per_s, 2),
        "tokens_plain": plain.tokens, "tokens_per_s_plain": round(plain.tokens_per_s, 2),
        "speedup": round(mtp.tokens_per_s / plain.tokens_per_s, 3) if plain.tokens_per_s else None,
        "decode_tokens_per_s_mtp": round(mtp.decode_tokens_per_s, 2),
        "decode_tokens_per_s_plain": round(plain.decode_tokens_per_s, 2),
        "decode_speedup": round(mtp.decode_tokens_per_s / plain.decode_tokens_per_s, 3)
        if plain.decode_tokens_per_s else None,
    }
