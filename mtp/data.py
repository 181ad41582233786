"""Stage 1 of `pdserve train-mtp`: the target writes the training data (token ids), with the
engine or the dense sampler, and the data file that `--resume` and `--extra-data` read."""

from __future__ import annotations

import math
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from engine.model.loader import LoadedModel
from engine.sampling.sampling_params import SamplingParams
from mtp.dense_sampler import DenseSampler
from mtp.files import progress
from mtp.prompts import HELDOUT_PROMPTS, chat_ids, read_prompts


@dataclass
class DataConfig:
    tokens: int  # generated tokens to collect (prompt tokens not counted)
    max_new_tokens: int = 320
    seconds: float = math.inf
    seed: int = 0
    max_num_seqs: int = 8
    greedy_fraction: float = 0.25
    temperatures: tuple[float, float] = (0.6, 1.0)


def _requests(encoded: list[list[int]], cfg: DataConfig) -> Iterator[tuple[list[int], SamplingParams]]:
    """Endless (prompt ids, params): first pass partly greedy, later passes sampled."""
    rng = random.Random(cfg.seed)
    for rnd in range(1 << 30):
        for ids in encoded:
            greedy = rnd == 0 and rng.random() < cfg.greedy_fraction
            temp = 0.0 if greedy else rng.uniform(*cfg.temperatures)
            yield ids, SamplingParams(temperature=temp, max_tokens=cfg.max_new_tokens, seed=rng.getrandbits(62))


def generate_data(loaded: LoadedModel, prompts: list[str], cfg: DataConfig, device: str) -> list[list[int]]:
    """Sample continuations with the engine until `cfg.tokens` are generated or time is up.

    Returns prompt + output token ids per request (requests cut at the end keep their part)."""
    from engine.engine import EngineConfig, LLMEngine

    encoded = [chat_ids(loaded.tokenizer, p) for p in prompts]
    max_len = max(len(e) for e in encoded) + cfg.max_new_tokens + 8
    engine = LLMEngine(loaded, EngineConfig(
        num_speculative_tokens=0, device=device, max_num_seqs=cfg.max_num_seqs, max_model_len=max_len,
        max_num_batched_tokens=max(512, 16 * cfg.max_num_seqs), kv_cache_bytes=_kv_bytes(device)))
    source = _requests(encoded, cfg)
    seqs: list[list[int]] = []
    produced, deadline = 0, time.monotonic() + cfg.seconds
    with progress(cfg.tokens, "generate") as bar:
        while produced < cfg.tokens and time.monotonic() < deadline:
            while len(engine.waiting) < cfg.max_num_seqs:
                engine.add_request(*next(source))
            for out in engine.step():
                produced += len(out.new_token_ids)
                bar.update(len(out.new_token_ids))
                if out.finish_reason is not None:
                    seqs.append(_take(engine, out.request_id))
        for rid in [r for r, req in engine.requests.items() if not req.finished]:
            engine.abort(rid)
        while engine.has_unfinished():
            engine.step()
        seqs += [_take(engine, rid) for rid in list(engine.requests)]
    return [s for s in seqs if len(s) >= 4]


def generate_dense(loaded: LoadedModel, prompts: list[str], cfg: DataConfig) -> list[list[int]]:
    """`generate_data` through a `DenseSampler` of `cfg.max_num_seqs` rows. Requests are drawn
    four waves at a time and sorted by prompt length, so a wave pads little."""
    encoded = [chat_ids(loaded.tokenizer, p) for p in prompts]
    source, rows = _requests(encoded, cfg), cfg.max_num_seqs
    sampler = DenseSampler(loaded.model, rows, max(len(e) for e in encoded) + cfg.max_new_tokens)
    seqs: list[list[int]] = []
    produced, deadline, wave = 0, time.monotonic() + cfg.seconds, 0
    with progress(cfg.tokens, "generate") as bar:
        while produced < cfg.tokens and time.monotonic() < deadline:
            pool = sorted((next(source) for _ in range(4 * rows)), key=lambda r: len(r[0]))
            for batch in (pool[i : i + rows] for i in range(0, len(pool), rows)):
                if produced >= cfg.tokens or time.monotonic() >= deadline:
                    break
                out = sampler.sample([x for x, _ in batch], [sp.temperature for _, sp in batch],
                                     cfg.max_new_tokens, loaded.eos_token_ids, cfg.seed + wave)
                new = sum(len(o) - len(x) for o, (x, _) in zip(out, batch, strict=True))
                produced, wave = produced + new, wave + 1
                bar.update(new)
                seqs += out
    return seqs


def user_turn_prefix(tokenizer: Any) -> list[int]:
    """Token ids of the chat template up to where a user message's text starts (system turn
    included). A chat model continues them with a plausible user request: self-written
    prompts in the form the model is served with (the Magpie recipe)."""
    if not getattr(tokenizer, "has_chat_template", False):
        raise ValueError("self-written prompts need a model with a chat template")
    marker = "@@PDSERVE-USER-TEXT@@"
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": marker}], add_generation_prompt=True)
    return list(tokenizer.encode(rendered[: rendered.index(marker)], add_special_tokens=False))


def keep_self_prompt(text: str) -> bool:
    """A self-written request worth answering: 16..400 characters, mostly printable ASCII."""
    text = text.strip()
    if not 16 <= len(text) <= 400:
        return False
    plain = sum(c.isascii() and (c.isprintable() or c == "\n") for c in text)
    return plain >= 0.97 * len(text)


def self_prompts(loaded: LoadedModel, count: int, cfg: DataConfig, max_new: int = 96) -> list[str]:
    """Up to `count` distinct user requests the target writes itself (temperature 0.7..1.0,
    waves of `cfg.max_num_seqs` rows), keeping those that ended and pass `keep_self_prompt`;
    held-out prompts are dropped."""
    prefix, rng = user_turn_prefix(loaded.tokenizer), random.Random(cfg.seed + 17)
    held = set(read_prompts(HELDOUT_PROMPTS))
    out: dict[str, None] = {}
    deadline, wave = time.monotonic() + cfg.seconds, 0
    sampler = DenseSampler(loaded.model, cfg.max_num_seqs, len(prefix) + max_new)
    with progress(count, "prompts") as bar:
        while len(out) < count and time.monotonic() < deadline:
            temps = [rng.uniform(0.7, 1.0) for _ in range(cfg.max_num_seqs)]
            rows = sampler.sample([prefix] * len(temps), temps, max_new, loaded.eos_token_ids,
                                  cfg.seed + 7919 * (wave + 1))
            wave += 1
            for row in rows:
                body = row[len(prefix) :]
                if not body or body[-1] not in loaded.eos_token_ids:
                    continue  # cut by the length limit
                text = loaded.tokenizer.decode(body[:-1]).strip()
                if keep_self_prompt(text) and text not in held and text not in out and len(out) < count:
                    out[text] = None
                    bar.update(1)
    return list(out)


def _take(engine: Any, request_id: str) -> list[int]:
    req = engine.requests.pop(request_id)
    return list(req.prompt) + list(req.output_ids)


def _kv_bytes(device: str) -> int:
    return (16 << 30) if device.startswith("cuda") else (512 << 20)


def save_data(seqs: list[list[int]], path: Path) -> None:
    lengths = torch.tensor([len(s) for s in seqs], dtype=torch.int64)
    flat = torch.tensor([t for s in seqs for t in s], dtype=torch.int32)
    save_file({"tokens": flat, "lengths": lengths}, str(path))


def load_data(path: Path) -> list[list[int]]:
    t = load_file(str(path))
    return [x.tolist() for x in torch.split(t["tokens"].long(), t["lengths"].tolist())]
