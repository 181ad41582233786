"""`pdserve bench engine`: single-process engine throughput and decode step time.

Runs the LLMEngine on a batch of random prompts with k = 0 and the given k, on `tiny`, the
embedded model, or random weights of a named real shape (`--arch smollm2`), so GPU machines
that lack the weights file can still time real shapes. Prints one JSON object per k.
`--draft-vocab N` drafts over the N most frequent tokens (FR-Spec); random weights use the
shipped ranking of the named model (its drafts are never accepted: this times the step).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from engine.config import ArchConfig
from engine.draft_vocab import ranking_path_beside
from engine.engine import EngineConfig, LLMEngine
from engine.loader import (
    LoadedModel,
    _materialize,
    build_model,
    load_model,
    mtp_path_default,
    random_weights,
    resolve_dtype,
)
from engine.model import load_weights
from engine.sampling_params import SamplingParams

SHAPES = {
    "smollm2": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, head_dim=64, rope_theta=100000.0,
                    max_position_embeddings=8192, tie_word_embeddings=True),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny", help="tiny, smollm2, a path; or use --arch")
    p.add_argument("--arch", choices=sorted(SHAPES), default=None, help="random weights of this shape")
    p.add_argument("--spec-tokens", type=int, default=3)
    p.add_argument("--draft-vocab", type=int, default=0, metavar="N",
                   help="MTP drafts score the N most frequent tokens (FR-Spec); 0 = all")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")


def random_model(arch: str, device: str, dtype: str) -> LoadedModel:
    config = ArchConfig(**SHAPES[arch], eos_token_ids=())  # type: ignore[arg-type]
    model = build_model(config)
    load_weights(model, *random_weights(model, 0))
    torch_dtype = resolve_dtype(dtype, device)
    return LoadedModel(f"random-{arch}", _materialize(model, device, torch_dtype), None, (), False,
                       ranking_path_beside(mtp_path_default(arch)))


def time_engine(loaded: LoadedModel, k: int, args: argparse.Namespace) -> dict:
    vocab = loaded.model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.batch)]
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    engine = LLMEngine(loaded, EngineConfig(num_speculative_tokens=k, draft_vocab_size=args.draft_vocab if k else 0,
                                            device=args.device,
                                            max_num_seqs=max(args.batch, 1),
                                            max_num_batched_tokens=args.batch * args.prompt_len,
                                            max_model_len=args.prompt_len + args.max_tokens + 8))
    engine.generate(prompts[:1], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    _sync(args.device)
    for p in prompts:
        engine.add_request(p, params)
    engine.step()  # the whole batch prefills in one step
    _sync(args.device)
    start, steps = time.perf_counter(), 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    _sync(args.device)
    elapsed = time.perf_counter() - start
    done = [r for r in engine.requests.values() if r.finished][-args.batch:]
    tokens = sum(len(r.output_ids) - 1 for r in done)
    return {"model": loaded.name, "device": args.device, "dtype": str(next(loaded.model.parameters()).dtype),
            "spec_tokens": k, "draft_vocab": (args.draft_vocab or None) if k else None, "batch": args.batch, "decode_tokens": tokens, "decode_steps": steps,
            "seconds": round(elapsed, 4), "tokens_per_s": round(tokens / elapsed, 1),
            "ms_per_step": round(1000 * elapsed / max(steps, 1), 3)}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run(args: argparse.Namespace) -> int:
    if args.arch:
        loaded = random_model(args.arch, args.device, args.dtype)
    else:
        loaded = load_model(args.model, device=args.device, dtype=args.dtype)
    for k in sorted({0, args.spec_tokens}):
        print(json.dumps(time_engine(loaded, k, args)), flush=True)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m engine.bench")
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
