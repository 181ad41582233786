"""`pdserve draft-vocab`: rank a model's vocabulary by how often the model itself writes each token.

Receives a model reference. Answers training prompts with the single-process engine (k = 0):
the written prompts of mtp/prompt_lists/train_prompts.txt and the topic x form prompts that
`pdserve train-mtp` also uses, shuffled, never the held-out prompts that `pdserve bench
acceptance` reads (any equal to one is dropped). A share of the answers is greedy, the rest
sampled at `--temperature`. Counts the answers' tokens until `--tokens` are counted, plus the
tokens of each answered prompt's own text (once; the chat template's fixed tokens are left
out). Hands on one small safetensors file: `ids` int32 [V], every token id by decreasing count,
ties by increasing id (a BPE tokenizer's lower ids are its earlier, more frequent merges);
`counts` int32 [V] in that order; and a summary in the metadata. Loaded beside a model's MTP
head ({stem}.vocab_rank.safetensors), its first N ids are the draft vocabulary of
`--draft-vocab N` (engine/spec_decode/draft_vocab.py).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from engine.engine import EngineConfig, LLMEngine
from engine.model.loader import LoadedModel, load_model
from engine.sampling.sampling_params import SamplingParams
from engine.spec_decode.draft_vocab import rank_by_count, write_ranking
from mtp.prompts import HELDOUT_PROMPTS, chat_ids, read_prompts, training_prompts

COVERAGE_SIZES = (2048, 4096, 8192, 16384, 32768)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="tiny, smollm2, a HF directory or a .gguf file")
    p.add_argument("--out", required=True, help="the ranking file (beside a head: STEM.vocab_rank.safetensors)")
    p.add_argument("--tokens", type=int, default=20_000, help="answer tokens to count")
    p.add_argument("--max-new-tokens", type=int, default=128, help="per answer")
    p.add_argument("--batch", type=int, default=32, help="requests decoded together")
    p.add_argument("--temperature", type=float, default=0.8, help="of the sampled answers")
    p.add_argument("--greedy-fraction", type=float, default=0.5, help="share of the answers that are greedy")
    p.add_argument("--num-prompts", type=int, default=None, help="use the first N (shuffled) prompts")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--seed", type=int, default=0)


def ranking_prompts(seed: int) -> list[str]:
    """The training prompts (written, topic x form; shuffled), held-out prompts dropped."""
    held = set(read_prompts(HELDOUT_PROMPTS))
    return [p for p in training_prompts(0, seed) if p not in held]


def count_tokens(loaded: LoadedModel, texts: list[str], args: argparse.Namespace) -> tuple[torch.Tensor, dict]:
    """Token counts [V] (int64) of the answers to `texts` and of the answered prompts' text."""
    vocab = loaded.model.config.vocab_size
    rng = random.Random(args.seed)
    prompts = [chat_ids(loaded.tokenizer, t) for t in texts]
    engine = LLMEngine(loaded, EngineConfig(
        num_speculative_tokens=0, device=args.device, max_num_seqs=args.batch,
        max_model_len=max(len(p) for p in prompts) + args.max_new_tokens + 8))
    rids: dict[str, str] = {}
    for i, (text, ids) in enumerate(zip(texts, prompts, strict=True)):
        temp = 0.0 if rng.random() < args.greedy_fraction else args.temperature
        params = SamplingParams(temperature=temp, max_tokens=args.max_new_tokens, seed=args.seed + i)
        rids[engine.add_request(ids, params)] = text
    answers = torch.zeros(vocab, dtype=torch.int64)
    answered: set[str] = set()
    counted = 0
    while engine.has_unfinished() and counted < args.tokens:
        for out in engine.step():
            answers += torch.bincount(torch.tensor(out.new_token_ids, dtype=torch.int64), minlength=vocab)
            counted += len(out.new_token_ids)
            answered.add(out.request_id)
    for rid in rids:
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    prompt_counts = torch.zeros(vocab, dtype=torch.int64)
    for rid in answered:
        ids = loaded.tokenizer.encode(rids[rid], add_special_tokens=False)
        prompt_counts += torch.bincount(torch.tensor(ids, dtype=torch.int64), minlength=vocab)
    summary = {"prompts_answered": len(answered), "answer_tokens": counted,
               "prompt_tokens": int(prompt_counts.sum())}
    return answers + prompt_counts, summary


def coverage(counts: torch.Tensor, ranking: torch.Tensor, sizes: tuple[int, ...]) -> dict[str, float]:
    """Share of the counted tokens inside the first N ranked ids (in-sample), per N < V."""
    total = max(int(counts.sum()), 1)
    ranked = counts[ranking].cumsum(0)
    return {str(n): round(int(ranked[n - 1]) / total, 4) for n in sizes if n < counts.shape[0]}


def run(args: argparse.Namespace) -> int:
    if args.tokens <= 0 or args.batch <= 0 or args.max_new_tokens <= 0:
        raise ValueError("--tokens, --batch and --max-new-tokens must be > 0")
    if not 0.0 <= args.greedy_fraction <= 1.0:
        raise ValueError("--greedy-fraction must be in 0..1")
    start = time.monotonic()
    loaded = load_model(args.model, device=args.device, dtype=args.dtype)
    texts = ranking_prompts(args.seed)[: args.num_prompts]
    if not texts:
        raise ValueError("no prompts")
    counts, summary = count_tokens(loaded, texts, args)
    meta = {"model": loaded.name, **summary, "distinct_tokens": int((counts > 0).sum()),
            "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
            "greedy_fraction": args.greedy_fraction, "seed": args.seed, "seconds": round(time.monotonic() - start, 1)}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta["coverage"] = coverage(counts, rank_by_count(counts), COVERAGE_SIZES)
    write_ranking(out, counts, meta)
    print(json.dumps({"out": str(out), **meta}), flush=True)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m mtp.vocab_rank")
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
