"""`pdserve train-mtp`: give a Llama-family model a DeepSeek-V3-form MTP head by self-distillation.

Receives a model reference (`tiny`, `smollm2`, a HF directory, a .gguf file) and writes a
standalone MTP safetensors file (DeepSeek key form, bf16 by default) that
`load_model(..., mtp_path=FILE)` reads. Three stages:
  1. data: the target samples continuations of chat-templated prompts (the lists in
     engine/mtp_heads/ and docstrings that ship with installed packages), partly greedy, mostly
     at temperature 0.6..1.0; token ids only. `--sampler dense` (default) is
     `engine.dense_sampler` (a batched loop over a contiguous KV cache, CUDA graphs; greedy
     output equal to the engine's, tested); `--sampler engine` uses the real `LLMEngine` (k = 0).
  2. train: teacher forcing. The frozen target runs a dense causal forward over each sequence
     (its normed hidden states and its next-token distribution at every position); the MTP
     module runs `levels` chained steps over the same sequence, exactly as the engine chains
     it (level j at index i reads level j-1's output there and the token at i+j, sits at
     position i+j-1); the loss is the cross-entropy of the MTP's distribution of the token
     after against the target's (soft labels: KL's gradient), at every level, on the answer's
     positions only (after the chat template's assistant opener: drafts are made only there).
     Embedding and LM head are the target's, frozen.
  3. save: resumable checkpoints (FILE.ckpt.pt, data in FILE.data.safetensors), the head,
     the loss curve (FILE.loss.png and FILE.loss.json).
The training forward reuses the modules' own code (`CausalLM.forward`, `mtp_forward`) through
the dense attention backends below; a test checks them against the engine's paged path.
Nothing here is used when serving.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import random
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch.nn.attention import sdpa_kernel

from engine.attention import AttentionBackend
from engine.dense_sampler import SDPA_BACKENDS, DenseSampler
from engine.loader import FEATURE_LAYERS_KEY, LoadedModel, check_feature_layers, load_model
from engine.model import CausalLM, MTPModule, mtp_state_dict
from engine.sampling_params import SamplingParams

HEADS_DIR = Path(__file__).parent / "mtp_heads"
TRAIN_PROMPTS = HEADS_DIR / "train_prompts.txt"
TRAIN_TOPICS = HEADS_DIR / "train_topics.txt"
HELDOUT_PROMPTS = HEADS_DIR / "heldout_prompts.txt"
HELDOUT_NEW_TOKENS = 96  # as `pdserve bench acceptance` answers them
TOPIC_FORMS = (
    "Tell me about {t}.", "Explain {t} in simple terms.", "Write a short poem about {t}.",
    "Give me three interesting facts about {t}.", "What are the pros and cons of {t}?",
    "Write a paragraph for a school report on {t}.", "What should a beginner know about {t}?",
    "Write a short story that involves {t}.", "Why is {t} important?",
    "Summarize the history of {t} in a few sentences.", "Ask me three quiz questions about {t}.",
)
TEXT_FORMS = (
    "Summarize the following text in a few sentences:\n\n{t}", "Explain this to a beginner:\n\n{t}",
    "What is the main idea of this passage?\n\n{t}", "Rewrite the following in plain English:\n\n{t}",
    "Write three questions someone might ask after reading this:\n\n{t}", "Continue this text:\n\n{t}",
)


# ---- prompts ---------------------------------------------------------------------------


def read_prompts(path: str | Path) -> list[str]:
    """Non-empty lines that do not start with '#'."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    return [s.strip() for s in lines if s.strip() and not s.lstrip().startswith("#")]


def chat_ids(tokenizer: Any, text: str) -> list[int]:
    """The prompt as the demo sends it: through the chat template when the model has one."""
    if getattr(tokenizer, "has_chat_template", False):
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        return list(tokenizer.encode(rendered, add_special_tokens=False))
    return list(tokenizer.encode(text, add_special_tokens=True))


def package_texts(limit: int, seed: int, seconds: float = 20.0) -> list[str]:
    """Module docstrings of installed packages (site-packages), 200..600 characters each."""
    roots = [Path(p) for p in sys.path if p.endswith(("site-packages", "dist-packages")) and Path(p).is_dir()]
    files = sorted(f for r in roots for pattern in ("*/*.py", "*/*/*.py") for f in r.glob(pattern))
    random.Random(seed).shuffle(files)
    out: list[str] = []
    deadline = time.monotonic() + seconds
    for f in files:
        if len(out) >= limit or time.monotonic() > deadline:
            break
        text = _docstring(f)
        if text:
            out.append(text)
    return out


def _docstring(path: Path) -> str | None:
    try:
        if path.stat().st_size > 200_000:
            return None
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
    except (SyntaxError, UnicodeDecodeError, OSError, ValueError):
        return None
    if not doc or len(doc) < 200:
        return None
    return doc[:600].rsplit(" ", 1)[0] if len(doc) > 600 else doc


def training_prompts(num_package_texts: int, seed: int) -> list[str]:
    """Written prompts, topic x form prompts, and package text x form prompts (shuffled)."""
    rng = random.Random(seed)
    prompts = read_prompts(TRAIN_PROMPTS)
    prompts += [f.format(t=t) for t in read_prompts(TRAIN_TOPICS) for f in TOPIC_FORMS]
    prompts += [rng.choice(TEXT_FORMS).format(t=t) for t in package_texts(num_package_texts, seed)]
    rng.shuffle(prompts)
    return prompts


# ---- stage 1: data ---------------------------------------------------------------------


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


# ---- stage 2: the training forward --------------------------------------------------------


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shape: tuple[int, int], scale: float,
            mask: torch.Tensor | None) -> torch.Tensor:
    """q: [B*L, Hq, D]; k, v: [B, S, Hkv, D] -> [B*L, Hq, D] (mask None: causal, S = L)."""
    b, n = shape
    hq, d = q.shape[1], q.shape[2]
    group = hq // k.shape[2]
    qb = q.view(b, n, hq, d).transpose(1, 2)
    kb = k.repeat_interleave(group, dim=2).transpose(1, 2).to(qb.dtype)
    vb = v.repeat_interleave(group, dim=2).transpose(1, 2).to(qb.dtype)
    with sdpa_kernel(SDPA_BACKENDS):
        out = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, is_causal=mask is None, scale=scale)
    return out.transpose(1, 2).reshape(b * n, hq, d)


class DenseCausalAttention(AttentionBackend):
    """Plain causal attention over a [batch, length] block of sequences; no KV cache."""

    def __init__(self, batch: int, length: int) -> None:
        self.shape = (batch, length)

    def forward(self, q, k, v, kv_cache, meta, scale):
        b, n = self.shape
        return _attend(q, k.view(b, n, *k.shape[1:]), v.view(b, n, *v.shape[1:]), self.shape, scale, None)


def chain_mask(level: int, length: int, device: torch.device) -> torch.Tensor:
    """[L, level*L] bool: level-1 keys at indices <= i, and index i's key of each later level."""
    idx = torch.arange(length, device=device)
    blocks = [idx.view(-1, 1) >= idx.view(1, -1)]
    blocks += [idx.view(-1, 1) == idx.view(1, -1)] * (level - 1)
    return torch.cat(blocks, dim=1)


class ChainAttention(AttentionBackend):
    """The MTP layer's attention over `levels` chained calls, as the engine's paged cache sees it.

    The engine writes level-1 keys for every verified position, then each chain step j at
    position p+j-1 overwrites that position with its own key; so level j at index i attends
    to level-1 keys at indices 0..i and to the keys of levels 2..j at index i. One instance
    per batch: call it once per level, in order."""

    def __init__(self, batch: int, length: int) -> None:
        self.shape = (batch, length)
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def forward(self, q, k, v, kv_cache, meta, scale):
        b, n = self.shape
        self.keys.append(k.view(b, n, *k.shape[1:]))
        self.values.append(v.view(b, n, *v.shape[1:]))
        if len(self.keys) == 1:
            return _attend(q, self.keys[0], self.values[0], self.shape, scale, None)
        mask = chain_mask(len(self.keys), n, q.device)
        return _attend(q, torch.cat(self.keys, 1), torch.cat(self.values, 1), self.shape, scale, mask)


def target_hidden(model: CausalLM, ids: torch.Tensor) -> torch.Tensor:
    """The target's final normed hidden states [B, L, H] for a padded id block [B, L]."""
    b, n = ids.shape
    pos = torch.arange(n, device=ids.device).repeat(b)
    with torch.no_grad():
        h = model(ids.reshape(-1), pos, [None] * model.num_layers, None, DenseCausalAttention(b, n))
    return h.view(b, n, -1)


def shift_left(ids: torch.Tensor, j: int) -> torch.Tensor:
    """ids[:, i + j] at index i (zeros past the end)."""
    return F.pad(ids[:, j:], (0, j))


def mtp_chain(model: CausalLM, ids: torch.Tensor, hidden: torch.Tensor, levels: int) -> list[torch.Tensor]:
    """Pre-norm MTP outputs [B, L, H] of chain levels 1..levels (level j: token at i+j, pos i+j-1)."""
    b, n = ids.shape
    attn = ChainAttention(b, n)
    base = torch.arange(n, device=ids.device).repeat(b)
    h_prev, outs = hidden.reshape(b * n, -1), []
    for j in range(1, levels + 1):
        nxt = shift_left(ids, j).reshape(-1)
        h_prev = model.mtp_forward(nxt, base + j - 1, h_prev, None, None, attn)
        outs.append(h_prev.view(b, n, -1))
    return outs


def _level_loss(model: CausalLM, mtp_h: torch.Tensor, tgt_h: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Cross-entropy of the MTP's distribution against the target's (soft labels; its gradient
    is KL's), the KL itself and the top-1 agreement (no grad), averaged over rows."""
    logits = model.mtp_logits(mtp_h)
    if logits.shape[0] == 0:  # no answer position at this level in the batch
        zero = logits.sum()
        return zero, zero.detach(), zero.detach()
    with torch.no_grad():
        logp = torch.log_softmax(model.compute_logits(tgt_h), dim=-1)
        p = logp.exp()
        entropy = -(p * logp).sum(-1).mean()
        agree = (logits.argmax(-1) == logp.argmax(-1)).float().mean()
    ce = F.cross_entropy(logits, p)
    return ce, ce.detach() - entropy, agree


def chain_losses(model: CausalLM, ids: torch.Tensor, lengths: torch.Tensor, levels: int,
                 starts: torch.Tensor | None = None) -> tuple[list[torch.Tensor], ...]:
    """Per-level loss, KL and top-1 agreement on a padded batch. Level j at index i predicts the
    token at i+j+1 from the target's state at i+j; it counts when that state is neither the
    row's last (nothing follows it) nor before `starts` (the answer's first index: drafts are
    only ever made for answer tokens after the first)."""
    hidden = target_hidden(model, ids)
    outs = mtp_chain(model, ids, hidden, levels)
    idx = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
    first = starts.unsqueeze(1) if starts is not None else torch.zeros_like(lengths).unsqueeze(1)
    losses, kls, agrees = [], [], []
    for j, out in enumerate(outs, start=1):
        valid = (idx + j < lengths.unsqueeze(1) - 1) & (idx + j >= first)
        tgt = F.pad(hidden[:, j:], (0, 0, 0, j))  # the target's state at i+j
        loss, kl, agree = _level_loss(model, out[valid], tgt[valid])
        losses.append(loss)
        kls.append(kl)
        agrees.append(agree)
    return losses, kls, agrees


# ---- stage 2: the loop ---------------------------------------------------------------------


@dataclass
class TrainConfig:
    steps: int
    levels: int = 3
    lr: float = 1e-3
    batch_tokens: int = 8192
    max_len: int = 768
    level_decay: float = 0.8  # level j's loss weight: decay ** (j - 1)
    seed: int = 0
    seconds: float = math.inf
    save_every: int = 200
    log_every: int = 10
    answer_marker: tuple[int, ...] = ()  # loss only after its last occurrence (`answer_marker`)


@dataclass
class TrainState:
    step: int = 0
    history: list[dict] = field(default_factory=list)


def plan_batches(seqs: list[list[int]], batch_tokens: int, max_len: int, seed: int) -> list[list[int]]:
    """Length-bucketed batches (padded size <= batch_tokens), in a seeded random order."""
    order = sorted(range(len(seqs)), key=lambda i: min(len(seqs[i]), max_len))
    batches: list[list[int]] = []
    cur: list[int] = []
    for i in order:
        n = min(len(seqs[i]), max_len)
        if cur and (len(cur) + 1) * n > batch_tokens:
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    random.Random(seed).shuffle(batches)
    return batches


def batch_tensors(seqs: list[list[int]], rows: list[int], max_len: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    cut = [seqs[i][:max_len] for i in rows]
    n = max(len(s) for s in cut)
    ids = torch.zeros(len(cut), n, dtype=torch.long)
    for r, s in enumerate(cut):
        ids[r, : len(s)] = torch.tensor(s)
    return ids.to(device), torch.tensor([len(s) for s in cut], device=device)


def batch_stream(seqs: list[list[int]], cfg: TrainConfig, start_step: int) -> Iterator[list[int]]:
    """The batch of every step from `start_step` on; epoch e is shuffled with seed + e."""
    epoch_len = len(plan_batches(seqs, cfg.batch_tokens, cfg.max_len, cfg.seed))
    step = start_step
    while True:
        epoch, pos = divmod(step, epoch_len)
        plan = plan_batches(seqs, cfg.batch_tokens, cfg.max_len, cfg.seed + epoch)
        for rows in plan[pos:]:
            yield rows
            step += 1


def lr_at(step: int, cfg: TrainConfig, elapsed: float = 0.0) -> float:
    """Linear warm-up, then cosine to 10% over the run: steps, or the time limit if it ends first."""
    warm = max(1, min(50, cfg.steps // 10))
    if step < warm:
        return cfg.lr * (step + 1) / warm
    frac = max((step - warm) / max(1, cfg.steps - warm), elapsed / cfg.seconds)
    return cfg.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(frac, 1.0))))


def prepare_for_training(model: CausalLM) -> list[torch.nn.Parameter]:
    """Freeze the target (embedding and LM head included); the MTP module trains in fp32."""
    assert model.mtp is not None, "model was built without an MTP module"
    model.requires_grad_(False)
    model.mtp.float().requires_grad_(True)
    return list(model.mtp.parameters())


def init_head(model: CausalLM, seed: int) -> None:
    """Warm start near "repeat the target's own prediction": eh_proj passes h_prev through (plus
    a little of the embedding; feature layers start unread); the block is the target's last
    layer with its output projections zeroed (an identity that trains; a wider MLP's extra
    rows are seeded random); shared_head.norm restores the scale of the target's normed hidden
    (the RMS of its final norm's weight)."""
    assert model.mtp is not None
    m, g = model.mtp, torch.Generator().manual_seed(seed)
    with torch.no_grad():
        _seed_new_parts(m, g)
        block = dict(m.block.named_parameters())
        for name, value in model.model.layers[-1].state_dict().items():
            copy_leading(block[name], value)
        m.block.self_attn.o_proj.weight.zero_()
        m.block.mlp.down_proj.weight.zero_()
        for norm in (m.enorm, m.hnorm):
            norm.weight.fill_(1.0)
        m.shared_head.norm.weight.fill_(float(model.model.norm.weight.float().pow(2).mean().sqrt()))
        h = model.config.hidden_size
        emb = torch.randn(h, h, generator=g) * (0.1 / math.sqrt(h))
        copy_leading(m.eh_proj.weight, torch.cat([emb, torch.eye(h)], dim=1))


def _seed_new_parts(m: MTPModule, g: torch.Generator) -> None:
    """What a head grows from nothing: random MLP rows (fan-in scaled), zero columns where
    they enter the residual stream (down_proj, eh_proj's feature inputs), unit feature norms."""
    for lin in (m.block.mlp.gate_proj, m.block.mlp.up_proj):
        lin.weight.copy_(torch.randn(lin.weight.shape, generator=g) / math.sqrt(lin.weight.shape[1]))
    m.block.mlp.down_proj.weight.zero_()
    m.eh_proj.weight.zero_()
    for weight in m.fnorms.parameters():
        weight.fill_(1.0)


def copy_leading(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy `src` into the leading corner of `dst` (same rank, no dimension larger)."""
    if src.dim() != dst.dim() or any(a > b for a, b in zip(src.shape, dst.shape, strict=True)):
        raise ValueError(f"cannot place a {tuple(src.shape)} tensor into {tuple(dst.shape)}")
    dst[tuple(slice(0, n) for n in src.shape)].copy_(src)


def grow_head(model: CausalLM, intermediate_size: int, feature_layers: tuple[int, ...], seed: int) -> None:
    """Give `model` a larger MTP module that computes exactly what its current one does: a wider
    MLP (new rows random, their down_proj columns zero) and/or earlier target layers as extra
    inputs (their eh_proj columns zero), so training starts from the current head's quality."""
    assert model.mtp is not None
    old = model.mtp
    config = replace(model.config, mtp_intermediate_size=max(intermediate_size, model.config.mtp_mlp_size),
                     mtp_feature_layers=feature_layers or model.config.mtp_feature_layers)
    if config.mtp_intermediate_size == config.intermediate_size:
        config = replace(config, mtp_intermediate_size=0)
    if not set(model.config.mtp_feature_layers) <= set(config.mtp_feature_layers):
        raise ValueError(f"feature layers {feature_layers} drop some of {model.config.mtp_feature_layers}")
    check_feature_layers(config.mtp_feature_layers, config.num_hidden_layers)
    param = next(old.parameters())
    new = MTPModule(config, model.rotary).to(param.device, param.dtype)
    with torch.no_grad():
        _seed_new_parts(new, torch.Generator().manual_seed(seed))
        params = dict(new.named_parameters())
        size = config.hidden_size
        for name, value in old.named_parameters():
            if name != "eh_proj.weight":
                copy_leading(params[name], value)
        # eh_proj's columns: [embedding, final hidden, feature layers in order]
        old_cols = [model.config.mtp_feature_layers.index(i) if i in model.config.mtp_feature_layers else None
                    for i in config.mtp_feature_layers]
        w_old, w_new = old.eh_proj.weight, new.eh_proj.weight
        w_new[:, : 2 * size] = w_old[:, : 2 * size]
        for j, o in enumerate(old_cols):
            if o is not None:
                w_new[:, (2 + j) * size : (3 + j) * size] = w_old[:, (2 + o) * size : (3 + o) * size]
                new.fnorms[j].load_state_dict(old.fnorms[o].state_dict())
    model.mtp, model.config = new, config


def answer_marker(tokenizer: Any) -> tuple[int, ...]:
    """The token ids a chat template appends to open the assistant's turn; () without one."""
    if not getattr(tokenizer, "has_chat_template", False):
        return ()
    msgs = [{"role": "user", "content": "x"}]
    opened = tokenizer.apply_chat_template(msgs, add_generation_prompt=True)
    closed = tokenizer.apply_chat_template(msgs, add_generation_prompt=False)
    if not opened.startswith(closed) or opened == closed:
        return ()
    return tuple(tokenizer.encode(opened[len(closed) :], add_special_tokens=False))


def answer_starts(ids: torch.Tensor, marker: tuple[int, ...]) -> torch.Tensor:
    """Per row of [B, L] ids: the index after the last occurrence of `marker` (0 if none)."""
    m, n = len(marker), ids.shape[1]
    if m == 0 or n < m:
        return torch.zeros(ids.shape[0], dtype=torch.long, device=ids.device)
    hit = torch.ones(ids.shape[0], n - m + 1, dtype=torch.bool, device=ids.device)
    for k, tok in enumerate(marker):
        hit &= ids[:, k : n - m + 1 + k] == tok
    at = torch.arange(1, n - m + 2, device=ids.device)  # 1-based so "no hit" is 0
    last = (hit * at).amax(dim=1)
    return torch.where(last > 0, last - 1 + m, 0)


def _weighted(values: list[torch.Tensor], cfg: TrainConfig) -> torch.Tensor:
    weights = [cfg.level_decay**j for j in range(len(values))]
    return torch.stack([w * v for w, v in zip(weights, values, strict=True)]).sum() / sum(weights)


def train_step(model: CausalLM, opt: torch.optim.Optimizer, ids: torch.Tensor, lengths: torch.Tensor,
               cfg: TrainConfig) -> dict:
    use_amp = ids.device.type == "cuda"
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=use_amp):
        losses, kls, agrees = chain_losses(model, ids, lengths, cfg.levels, answer_starts(ids, cfg.answer_marker))
    opt.zero_grad(set_to_none=True)
    _weighted(losses, cfg).backward()
    assert model.mtp is not None
    torch.nn.utils.clip_grad_norm_(model.mtp.parameters(), 1.0)
    opt.step()
    return {"loss": _weighted(kls, cfg).item(), "kl": [float(x) for x in kls], "agree": [float(a) for a in agrees]}


def train(model: CausalLM, seqs: list[list[int]], cfg: TrainConfig, device: str, ckpt: Path | None,
          resume: bool, fresh: bool = True) -> TrainState:
    """Train the MTP module from its checkpoint (`resume`), else from the warm start (`fresh`),
    else from the weights it holds."""
    params = prepare_for_training(model)
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    state = TrainState()
    if resume and ckpt is not None and ckpt.exists():
        state = load_checkpoint(model, opt, ckpt)
        print(f"resuming from step {state.step} ({ckpt})", flush=True)
    elif fresh:
        init_head(model, cfg.seed)
    start = time.monotonic()
    batches = batch_stream(seqs, cfg, state.step)
    with progress(cfg.steps, "train", initial=state.step) as bar:
        while state.step < cfg.steps and time.monotonic() - start < cfg.seconds:
            lr = lr_at(state.step, cfg, time.monotonic() - start)
            for group in opt.param_groups:
                group["lr"] = lr
            rec = train_step(model, opt, *batch_tensors(seqs, next(batches), cfg.max_len, device), cfg)
            state.step += 1
            bar.update(1)
            if state.step % cfg.log_every == 0 or state.step == 1:
                state.history.append({"step": state.step, "lr": lr, **rec})
                bar.set_postfix(loss=f"{rec['loss']:.3f}", agree1=f"{rec['agree'][0]:.2f}")
            if ckpt is not None and state.step % cfg.save_every == 0:
                save_checkpoint(model, opt, state, ckpt)
    if ckpt is not None:
        save_checkpoint(model, opt, state, ckpt)
    return state


def evaluate(model: CausalLM, seqs: list[list[int]], cfg: TrainConfig, device: str, max_batches: int = 8) -> dict:
    """Mean per-level KL and top-1 agreement on sequences kept out of training (answer
    positions only when `cfg.answer_marker` is set)."""
    rows_kl, rows_ag = [], []
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.startswith("cuda")):
        for rows in plan_batches(seqs, cfg.batch_tokens, cfg.max_len, 0)[:max_batches]:
            ids, lengths = batch_tensors(seqs, rows, cfg.max_len, device)
            _, kls, ags = chain_losses(model, ids, lengths, cfg.levels, answer_starts(ids, cfg.answer_marker))
            rows_kl.append([float(x) for x in kls])
            rows_ag.append([float(x) for x in ags])
    mean = lambda rows: [sum(c) / len(c) for c in zip(*rows, strict=True)]  # noqa: E731
    return {"kl": mean(rows_kl), "agree": mean(rows_ag)} if rows_kl else {}


def heldout_agreement(loaded: LoadedModel, cfg: TrainConfig, device: str, max_new: int) -> list[float]:
    """Per-level top-1 agreement, teacher-forced, on the target's greedy answers to the held-out
    prompts (answer positions only when the model has a chat template): what a greedy
    `pdserve bench acceptance` run's first-draft acceptance follows."""
    prompts = [chat_ids(loaded.tokenizer, p) for p in read_prompts(HELDOUT_PROMPTS)]
    sampler = DenseSampler(loaded.model, len(prompts), max(len(x) for x in prompts) + max_new)
    answers = sampler.sample(prompts, [0.0] * len(prompts), max_new, loaded.eos_token_ids, seed=0)
    return evaluate(loaded.model, answers, cfg, device).get("agree", [])


# ---- stage 3: files ------------------------------------------------------------------------


def save_checkpoint(model: CausalLM, opt: torch.optim.Optimizer, state: TrainState, path: Path) -> None:
    assert model.mtp is not None
    tmp = path.with_suffix(".tmp")
    torch.save({"mtp": model.mtp.state_dict(), "opt": opt.state_dict(), "step": state.step,
                "history": state.history}, tmp)
    tmp.replace(path)


def load_checkpoint(model: CausalLM, opt: torch.optim.Optimizer, path: Path) -> TrainState:
    assert model.mtp is not None
    blob = torch.load(path, map_location=next(model.mtp.parameters()).device, weights_only=True)
    model.mtp.load_state_dict(blob["mtp"])
    opt.load_state_dict(blob["opt"])
    return TrainState(int(blob["step"]), list(blob["history"]))


def save_head(model: CausalLM, path: Path, dtype: torch.dtype, meta: dict[str, str]) -> dict[str, torch.Tensor]:
    """The MTP module as a standalone DeepSeek-form safetensors file (the feature layers it reads,
    if any, in its metadata); returns what was saved."""
    tensors = {k: v.to("cpu", dtype).contiguous() for k, v in mtp_state_dict(model).items()}
    if model.config.mtp_feature_layers:
        meta = {**meta, FEATURE_LAYERS_KEY: ",".join(map(str, model.config.mtp_feature_layers))}
    save_file(tensors, str(path), metadata=meta)
    return tensors


def save_loss_curve(history: list[dict], path: Path) -> None:
    """Per-level KL against step as a PNG (matplotlib when installed, else a bare line plot)."""
    if not history:
        return
    steps = [h["step"] for h in history]
    curves = list(zip(*(h["kl"] for h in history), strict=True))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        write_line_png(path, steps, [list(c) for c in curves])
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for j, c in enumerate(curves, start=1):
        ax.plot(steps, c, label=f"level {j} (draft {j})")
    ax.set(xlabel="step", ylabel="KL(target || MTP), nats", yscale="log", title=path.stem)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_line_png(path: Path, xs: list[float], curves: list[list[float]], size: tuple[int, int] = (640, 360)) -> None:
    """A minimal PNG (zlib only): white canvas, grey axes, one colored polyline per curve."""
    import struct
    import zlib

    w, h = size
    img = bytearray(b"\xff" * (w * h * 3))
    colors = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40)]
    ys = [math.log(max(v, 1e-6)) for c in curves for v in c]
    lo, hi, x0, x1 = min(ys), max(ys) + 1e-9, min(xs), max(xs) + 1e-9
    px = lambda x: int(40 + (x - x0) / (x1 - x0) * (w - 60))  # noqa: E731
    py = lambda y: int(h - 30 - (math.log(max(y, 1e-6)) - lo) / (hi - lo) * (h - 50))  # noqa: E731
    for x in range(40, w - 19):
        _put(img, w, h, x, h - 30, (128, 128, 128))
    for y in range(20, h - 29):
        _put(img, w, h, 40, y, (128, 128, 128))
    for c, color in zip(curves, colors * 4, strict=False):
        pts = [(px(x), py(y)) for x, y in zip(xs, c, strict=True)]
        for (ax_, ay), (bx, by) in zip(pts, pts[1:], strict=False):
            n = max(abs(bx - ax_), abs(by - ay), 1)
            for t in range(n + 1):
                _put(img, w, h, ax_ + (bx - ax_) * t // n, ay + (by - ay) * t // n, color)
    raw = b"".join(b"\x00" + bytes(img[r * w * 3 : (r + 1) * w * 3]) for r in range(h))
    chunk = lambda tag, data: struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))  # noqa: E731
    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
    path.write_bytes(png + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


def _put(img: bytearray, w: int, h: int, x: int, y: int, color: tuple[int, int, int]) -> None:
    if 0 <= x < w and 0 <= y < h:
        img[(y * w + x) * 3 : (y * w + x) * 3 + 3] = bytes(color)


class _Progress:
    """A progress line on stderr when tqdm is absent (same `update`/`set_postfix` calls)."""

    def __init__(self, total: int, desc: str, initial: int = 0) -> None:
        self.total, self.desc, self.n, self.post, self.last = total, desc, initial, "", 0.0

    def update(self, n: int) -> None:
        self.n += n
        if time.monotonic() - self.last > 5 or self.n >= self.total:
            self.last = time.monotonic()
            print(f"{self.desc}: {self.n}/{self.total} {self.post}", file=sys.stderr, flush=True)

    def set_postfix(self, **kw: str) -> None:
        self.post = " ".join(f"{k}={v}" for k, v in kw.items())

    def __enter__(self) -> _Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def progress(total: int, desc: str, initial: int = 0) -> Any:
    try:
        from tqdm import tqdm
    except ImportError:
        return _Progress(total, desc, initial)
    return tqdm(total=total, desc=desc, initial=initial, mininterval=2.0, file=sys.stderr, disable=None)  # quiet off a TTY


# ---- command line --------------------------------------------------------------------------


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
    parser = argparse.ArgumentParser(prog="python -m engine.mtp_train")
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
