"""Stage 2 of `pdserve train-mtp`, the loop: batches, learning rate, the head's warm start or
growth, train steps over answer positions, evaluation (validation and held-out agreement), and
the resumable checkpoint."""

from __future__ import annotations

import math
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from engine.model.llama import CausalLM, MTPModule
from engine.model.loader import LoadedModel, check_feature_layers
from mtp.dense_sampler import DenseSampler
from mtp.files import progress
from mtp.forward import chain_losses
from mtp.prompts import HELDOUT_PROMPTS, chat_ids, read_prompts


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
