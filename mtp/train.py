"""`pdserve train-mtp`: give a Llama-family model a DeepSeek-V3-form MTP head by self-distillation.

Receives a model reference (`tiny`, `smollm2`, a HF directory, a .gguf file) and writes a
standalone MTP safetensors file (DeepSeek key form, bf16 by default) that
`load_model(..., mtp_path=FILE)` reads. Three stages:
  1. data (mtp/data.py): the target samples continuations of chat-templated prompts
     (mtp/prompts.py: the lists in mtp/prompt_lists/ and docstrings that ship with installed
     packages), partly greedy, mostly at temperature 0.6..1.0; token ids only. `--sampler dense`
     (default) is `mtp.dense_sampler` (a batched loop over a contiguous KV cache, CUDA graphs;
     greedy output equal to the engine's, tested); `--sampler engine` uses the real `LLMEngine`
     (k = 0).
  2. train (mtp/forward.py, mtp/loop.py): teacher forcing. The frozen target runs a dense causal
     forward over each sequence (its normed hidden states and its next-token distribution at
     every position); the MTP module runs `levels` chained steps over the same sequence, exactly
     as the engine chains it (level j at index i reads level j-1's output there and the token at
     i+j, sits at position i+j-1); the loss is the cross-entropy of the MTP's distribution of the
     token after against the target's (soft labels: KL's gradient), at every level, on the
     answer's positions only (after the chat template's assistant opener: drafts are made only
     there). Embedding and LM head are the target's, frozen.
  3. save (mtp/loop.py, mtp/files.py): resumable checkpoints (FILE.ckpt.pt, data in
     FILE.data.safetensors), the head, the loss curve (FILE.loss.png and FILE.loss.json).
The training forward reuses the modules' own code (`CausalLM.forward`, `mtp_forward`) through
the dense attention backends of mtp/forward.py; a test checks them against the engine's paged
path. Nothing here is used when serving.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from dataclasses import replace
from pathlib import Path

import torch

from engine.model.loader import LoadedModel, load_model
from mtp.data import DataConfig, generate_data, generate_dense, load_data, save_data, self_prompts
from mtp.files import save_head, save_loss_curve
from mtp.loop import (
    TrainConfig,
    TrainState,
    answer_marker,
    evaluate,
    grow_head,
    heldout_agreement,
    train,
)
from mtp.prompts import HELDOUT_NEW_TOKENS, training_prompts


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="tiny, smollm2, a HF directory or a .gguf file")
    p.add_argument("--out", required=True, help="the head's safetensors file (side files: .ckpt.pt, .data.safetensors, .loss.png, .loss.json)")
    p.add_argument("--tokens", type=int, default=200_000, help="generated training tokens")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--levels", type=int, default=3, help="chained MTP steps trained (the k it is built for)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--level-decay", type=float, default=0.8, help="level j's loss weight is decay ** (j - 1)")
    p.add_argument("--batch-tokens", type=int, default=8192, help="padded tokens per training step")
    p.add_argument("--max-len", type=int, default=768)
    p.add_argument("--max-new-tokens", type=int, default=320, help="per sampled continuation")
    p.add_argument("--greedy-fraction", type=float, default=0.25,
                   help="share of the first pass over the prompts answered greedily (the rest: T 0.6..1.0)")
    p.add_argument("--max-num-seqs", type=int, default=None, help="generation batch (default: 1024 on cuda, 8 on cpu)")
    p.add_argument("--sampler", choices=["dense", "engine"], default="dense",
                   help="dense: batched loop over a contiguous KV cache (fast); engine: the LLMEngine")
    p.add_argument("--init", default=None, help="start from this head (safetensors) instead of the warm start")
    p.add_argument("--mtp-intermediate", type=int, default=0,
                   help="widen the head's MLP to this size (default: keep; a new head: the target's)")
    p.add_argument("--feature-layers", default="",
                   help="comma-separated target layers whose outputs the head also reads (EAGLE-3's fused features)")
    p.add_argument("--extra-data", action="append", default=[], help="also train on this data file (repeatable)")
    p.add_argument("--package-texts", type=int, default=3000, help="docstrings of installed packages used as prompts")
    p.add_argument("--self-prompts", type=int, default=0,
                   help="also this many user requests the model writes itself from its chat template's user turn")
    p.add_argument("--gen-seconds", type=float, default=math.inf, help="stop generating after this long")
    p.add_argument("--train-seconds", type=float, default=math.inf, help="stop training (and save) after this long")
    p.add_argument("--save-dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--resume", action="store_true", help="continue from OUT.ckpt.pt and reuse OUT.data.safetensors")
    p.add_argument("--seed", type=int, default=0)


def side_files(out: Path) -> dict[str, Path]:
    stem = out.with_suffix("")
    return {k: Path(f"{stem}.{k}") for k in ("ckpt.pt", "data.safetensors", "loss.png", "loss.json")}


def get_data(loaded: LoadedModel, args: argparse.Namespace, path: Path) -> list[list[int]]:
    """Prompts (written, topic x form, package texts, self-written), then their continuations;
    both stages share `--gen-seconds` (self-written prompts take at most a quarter of it)."""
    if args.resume and path.exists():
        print(f"reusing training data {path}", flush=True)
        return load_data(path)
    start, cuda = time.monotonic(), args.device.startswith("cuda")
    cfg = DataConfig(tokens=args.tokens, max_new_tokens=args.max_new_tokens, seconds=args.gen_seconds,
                     greedy_fraction=args.greedy_fraction,
                     seed=args.seed, max_num_seqs=args.max_num_seqs or (1024 if cuda else 8))
    prompts = training_prompts(args.package_texts if loaded.name != "tiny" else 0, args.seed)
    if args.self_prompts > 0:
        prompts += self_prompts(loaded, args.self_prompts, replace(cfg, seconds=args.gen_seconds / 4))
        random.Random(args.seed).shuffle(prompts)
    print(f"{len(prompts)} prompts", flush=True)
    cfg = replace(cfg, seconds=args.gen_seconds - (time.monotonic() - start))
    if args.sampler == "dense":
        seqs = generate_dense(loaded, prompts, cfg)
    else:
        seqs = generate_data(loaded, prompts, cfg, args.device)
    save_data(seqs, path)
    return seqs


def run(args: argparse.Namespace) -> int:
    if args.steps <= 0 or args.tokens <= 0 or args.levels <= 0:
        raise ValueError("--steps, --tokens and --levels must be > 0")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    files = side_files(out)
    start = time.monotonic()
    loaded = load_model(args.model, device=args.device, mtp_path=args.init)
    features = tuple(int(x) for x in args.feature_layers.split(",") if x.strip())
    if args.mtp_intermediate or features:
        grow_head(loaded.model, args.mtp_intermediate, features, args.seed)
    seqs = get_data(loaded, args, files["data.safetensors"])
    seqs += [s for f in args.extra_data for s in load_data(Path(f))]
    gen_s = time.monotonic() - start
    rng = random.Random(args.seed)
    rng.shuffle(seqs)
    held = max(1, len(seqs) // 50)
    val, train_seqs = seqs[:held], seqs[held:]
    cfg = TrainConfig(steps=args.steps, levels=args.levels, lr=args.lr, batch_tokens=args.batch_tokens,
                      max_len=args.max_len, seed=args.seed, seconds=args.train_seconds, level_decay=args.level_decay,
                      answer_marker=answer_marker(loaded.tokenizer))
    state = train(loaded.model, train_seqs, cfg, args.device, files["ckpt.pt"], args.resume, fresh=args.init is None)
    report = summarize(loaded, seqs, state, evaluate(loaded.model, val, cfg, args.device), gen_s,
                       time.monotonic() - start - gen_s)
    report["heldout_agree"] = heldout_agreement(loaded, cfg, args.device, HELDOUT_NEW_TOKENS)
    meta = {k: json.dumps(v) for k, v in report.items() if k != "history"}
    save_head(loaded.model, out, getattr(torch, args.save_dtype), meta)
    files["loss.json"].write_text(json.dumps(report, indent=1))
    save_loss_curve(state.history, files["loss.png"])
    print(json.dumps({k: v for k, v in report.items() if k != "history"}), flush=True)
    return 0


def summarize(loaded: LoadedModel, seqs: list[list[int]], state: TrainState, val: dict, gen_s: float,
              train_s: float) -> dict:
    first, last = (state.history[0], state.history[-1]) if state.history else ({}, {})
    return {"model": loaded.name, "sequences": len(seqs), "tokens": sum(len(s) for s in seqs),
            "steps": state.step, "first_loss": first.get("loss"), "final_loss": last.get("loss"),
            "val_kl": val.get("kl"), "val_agree": val.get("agree"),
            "generate_s": round(gen_s, 1), "train_s": round(train_s, 1), "history": state.history}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m mtp.train")
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
