"""Where `pdserve generate`'s start-up goes (issue 26), one phase at a time, in one process:
import torch, CUDA init, the engine's imports, the GGUF read (header, metadata, tensor table),
dequantization on the device, the tokenizer, the MTP head file, the empty model, the weight copy,
the engine build (decode graphs) and the first token. The device is synchronized after each phase.

    python bench/gpu/startup_phases.py --model /tmp/smollm2.gguf --device cuda --spec-tokens 3

Prints one line of phases (seconds) and, with --json, one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

T0 = time.perf_counter()
import torch  # noqa: E402

PHASES: dict[str, float] = {"import torch": time.perf_counter() - T0}


def mark(name: str, since: list[float], device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)
    now = time.perf_counter()
    PHASES[name] = now - since[0]
    since[0] = now


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="a .gguf file")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--spec-tokens", type=int, default=3)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    since = [time.perf_counter()]
    if args.device.startswith("cuda"):
        torch.empty(1, device=args.device)
        mark("CUDA init", since, args.device)
    loaded = load(args, since)
    first_token(loaded, args, since)
    total = sum(PHASES.values())
    print(", ".join(f"{k} {v:.3f}" for k, v in PHASES.items()) + f"; total {total:.2f} s", file=sys.stderr)
    if args.json:
        print(json.dumps({"device": args.device, "phases_s": {k: round(v, 4) for k, v in PHASES.items()}}))


def load(args: argparse.Namespace, since: list[float]):
    from engine import gguf_loader
    from engine.loader import (
        LoadedModel,
        empty_model,
        mtp_path_default,
        read_head,
        resolve_dtype,
        served_name,
    )
    from engine.model import load_weights, split_mtp_tensors
    from engine.tokenizer import Tokenizer

    mark("engine imports", since, args.device)
    dtype = resolve_dtype(args.dtype, args.device)
    reader = gguf_loader.open_gguf(args.model)
    config = gguf_loader.arch_config_from_gguf(reader)
    mark("GGUF read", since, args.device)
    tensors = gguf_loader.load_gguf_tensors(reader, config, args.device, dtype)
    mark("dequantize", since, args.device)
    tokenizer = Tokenizer.from_gguf_metadata(reader)
    mark("tokenizer", since, args.device)
    target, _ = split_mtp_tensors(tensors, config.num_hidden_layers)
    head = mtp_path_default(served_name(args.model))
    assert head is not None, "no shipped MTP head for this model"
    mtp, config = read_head(head, config)
    mark("MTP head", since, args.device)
    model = empty_model(config, args.device, dtype)
    mark("empty model", since, args.device)
    load_weights(model, target, mtp)
    mark("weight copy", since, args.device)
    name = served_name(args.model)
    return LoadedModel(name, model, tokenizer, tokenizer.eos_token_ids, True)


def first_token(loaded, args: argparse.Namespace, since: list[float]) -> None:
    from engine.engine import EngineConfig, LLMEngine
    from engine.sampling_params import SamplingParams

    engine = LLMEngine(loaded, EngineConfig(num_speculative_tokens=args.spec_tokens, device=args.device,
                                            max_num_seqs=1))
    mark("engine build", since, args.device)
    prompt = loaded.tokenizer.encode(loaded.tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}]))
    engine.generate([prompt], SamplingParams(max_tokens=1))
    mark("first token", since, args.device)


if __name__ == "__main__":
    main()
