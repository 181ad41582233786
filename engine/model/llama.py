"""Llama-family decoder (Llama 3.x, SmolLM2, Qwen2, Qwen3) and the DeepSeek-V3-form MTP module.

Single-device model code: parameter names follow Hugging Face so checkpoints load by name;
tensor parallelism and quantization are transforms applied after `build` (a later issue).
The forward takes flattened tokens of a whole step plus `AttentionMetadata`; it never syncs.

The target's `forward` returns the final *normed* hidden states (what the LM head reads);
the MTP module consumes those as `h_prev`:
    h = eh_proj(cat[enorm(embed(x_next)), hnorm(h_prev)]) -> decoder layer -> shared_head
and returns its pre-norm output, which is also the `h_prev` of the next chained draft.

A pdserve-trained head may also read the outputs of some earlier target layers
(`config.mtp_feature_layers`, as EAGLE-3 fuses low, middle and high features): the target's
`forward` then returns them after the final hidden state, [T, (1 + F) * hidden], each gets
its own norm in `eh_proj`'s input, and chained drafts (which have no target state) read zeros
there. Its MLP may be wider than the target's (`config.mtp_intermediate_size`).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from engine.model.attention import AttentionBackend, AttentionMetadata
from engine.model.config import ArchConfig
from kernels._dispatch import use_triton
from kernels.linear import TokenMask, linear, linear_argmax, linear_glu
from kernels.norm import embed_with_sumsq, mtp_input, rms_norm


class Linear(nn.Linear):
    """nn.Linear through `kernels.linear.linear`: batch-invariant under `--deterministic`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    """`folded` (set by `fuse_projections`): the weight has been multiplied into the columns of
    the GEMM weights that read this norm's output, so the norm itself applies none."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.folded = False

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return rms_norm(x, None if self.folded else self.weight, self.eps, out)

    @property
    def spec(self) -> tuple[torch.Tensor | None, float]:
        """(weight, eps): what `kernels.linear.linear(norm=...)` applies in front of a GEMM; a
        folded norm's weight is None, and the GEMM kernels then normalize x themselves."""
        return None if self.folded else self.weight, self.eps


def rope_inv_freq(config: ArchConfig) -> torch.Tensor:
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: default, linear, llama3)")


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_len = float(s["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Non-interleaved RoPE (rotate_half), cos/sin cached in fp32 for every position."""

    def __init__(self, config: ArchConfig, max_positions: int) -> None:
        super().__init__()
        freqs = torch.outer(torch.arange(max_positions).float(), rope_inv_freq(config))
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        xf = x.float()
        half = xf.shape[-1] // 2
        rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
        return (xf * cos + rotated * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: ArchConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        c = config
        self.num_heads, self.num_kv_heads, self.head_dim = (
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
        )
        self.q_proj = Linear(c.hidden_size, c.q_size, bias=c.attention_bias)
        self.k_proj = Linear(c.hidden_size, c.kv_size, bias=c.attention_bias)
        self.v_proj = Linear(c.hidden_size, c.kv_size, bias=c.attention_bias)
        self.o_proj = Linear(c.q_size, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps) if c.qk_norm else None
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps) if c.qk_norm else None
        self.rotary = [rotary]  # shared, kept out of the module tree
        self.scale = c.head_dim**-0.5
        self.qkv: tuple[torch.Tensor, torch.Tensor | None] | None = None  # set by `fuse_projections`

    def forward(self, positions, x, kv_cache, meta: AttentionMetadata, backend: AttentionBackend, norm: RMSNorm):
        """x + o_proj(attention(norm(x))) on the residual stream x: at decode sizes on a GPU the
        norm runs inside the q/k/v GEMM and the add inside o_proj's (kernels/linear.py); a fresh
        prefill step may take the backend's fused projection + rotary (`project_forward`)."""
        t = x.shape[0]
        out = None
        if self.qkv is not None and self.q_norm is None and not self.q_proj.weight.requires_grad:
            out = backend.project_forward(x, norm.spec, self.qkv, (self.num_heads, self.num_kv_heads, self.head_dim),
                                          self.rotary[0], positions, kv_cache, meta, self.scale)
        if out is None:
            q, k, v = self._project(x, norm)
            if self.q_norm is not None and self.k_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            out = backend.rope_forward(self.rotary[0], positions, q, k, v, kv_cache, meta, self.scale)
        return linear(out.reshape(t, -1), self.o_proj.weight, self.o_proj.bias, residual=x)

    def _project(self, x: torch.Tensor, norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k and v [T, Hkv, D] of norm(x): views of one GEMM's output once fused."""
        t, d = x.shape[0], self.head_dim
        if self.qkv is None or self.q_proj.weight.requires_grad:  # training reads the parameters
            h = norm(x)
            return (self.q_proj(h).view(t, -1, d), self.k_proj(h).view(t, -1, d), self.v_proj(h).view(t, -1, d))
        out = linear(x, *self.qkv, norm=norm.spec)
        q, k, v = out.split([self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d], dim=-1)
        return q.view(t, -1, d), k.view(t, -1, d), v.view(t, -1, d)


class MLP(nn.Module):
    def __init__(self, config: ArchConfig, intermediate_size: int | None = None) -> None:
        super().__init__()
        inter = intermediate_size or config.intermediate_size
        self.gate_proj = Linear(config.hidden_size, inter, bias=False)
        self.up_proj = Linear(config.hidden_size, inter, bias=False)
        self.down_proj = Linear(inter, config.hidden_size, bias=False)
        self.gate_up: torch.Tensor | None = None  # [2 * inter, hidden], set by `fuse_projections`

    def forward(self, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        """x + mlp(norm(x)) on the residual stream x; once fused, the GEMMs carry the norm and
        the add (kernels/linear.py)."""
        if self.gate_up is not None and not self.gate_proj.weight.requires_grad:
            return linear(linear_glu(x, self.gate_up, norm=norm.spec), self.down_proj.weight, residual=x)
        h = norm(x)
        return x + self.down_proj(nn.functional.silu(self.gate_proj(h)) * self.up_proj(h))


class DecoderLayer(nn.Module):
    def __init__(self, config: ArchConfig, rotary: RotaryEmbedding, intermediate_size: int | None = None) -> None:
        super().__init__()
        self.self_attn = Attention(config, rotary)
        self.mlp = MLP(config, intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions, x, kv_cache, meta, backend):
        """The layer on the residual stream x; returns the stream after it."""
        x = self.self_attn(positions, x, kv_cache, meta, backend, self.input_layernorm)
        return self.mlp(x, self.post_attention_layernorm)


class LlamaModel(nn.Module):
    def __init__(self, config: ArchConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [DecoderLayer(config, rotary) for _ in range(config.num_hidden_layers)]
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class SharedHead(nn.Module):
    """DeepSeek's `shared_head`: its norm is the MTP's own; its `head` is the target's LM head."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.norm = RMSNorm(dim, eps)


class MTPModule(nn.Module):
    """One DeepSeek-V3 MTP layer; chained k times for k drafts. Shares embed and LM head."""

    def __init__(self, config: ArchConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        h = config.hidden_size
        self.enorm = RMSNorm(h, config.rms_norm_eps)
        self.hnorm = RMSNorm(h, config.rms_norm_eps)
        self.fnorms = nn.ModuleList([RMSNorm(h, config.rms_norm_eps) for _ in config.mtp_feature_layers])
        self.eh_proj = Linear((2 + len(config.mtp_feature_layers)) * h, h, bias=False)
        self.block = DecoderLayer(config, rotary, config.mtp_mlp_size)
        self.shared_head = SharedHead(h, config.rms_norm_eps)


class CausalLM(nn.Module):
    """Target model + optional MTP module. Parameter names match HF checkpoints."""

    def __init__(self, config: ArchConfig, max_positions: int, with_mtp: bool) -> None:
        super().__init__()
        self.config = config
        self.rotary = RotaryEmbedding(config, max_positions)
        self.model = LlamaModel(config, self.rotary)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.mtp = MTPModule(config, self.rotary) if with_mtp else None

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    def forward(self, input_ids, positions, kv_caches, meta, backend, on_layer=None) -> torch.Tensor:
        """Target forward over a step's flattened tokens; returns normed hidden [T, hidden],
        followed by the MTP's feature layers' outputs when it reads any ([T, (1 + F) * hidden]).

        `on_layer(i)`, when given, is called as soon as layer i's work is queued (its KV is
        written in stream order): the prefill node pushes that layer's blocks from there.
        """
        wanted = self.config.mtp_feature_layers if self.mtp is not None else ()
        features = []
        x = self._embed(input_ids)
        for i, (layer, cache) in enumerate(zip(self.model.layers, kv_caches, strict=False)):
            x = layer(positions, x, cache, meta, backend)
            if i in wanted:
                features.append(x.clone())  # the next layer's residual add may update x in place
            if on_layer is not None:
                on_layer(i)
        h = self.model.norm(x)
        return torch.cat([h, *features], dim=-1) if features else h

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The target's input rows: through `embed_with_sumsq` where the Triton kernels run (the
        gather leaves its rows' sums of squares, so the first layer's folded input norm needs no
        launch of its own)."""
        emb = self.model.embed_tokens
        if type(emb) is nn.Embedding and input_ids.dim() == 1 and use_triton(emb.weight, input_ids):
            return embed_with_sumsq(input_ids, emb.weight)
        return emb(input_ids)

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        """LM-head logits; `float32=False` keeps the model dtype (an argmax needs no cast)."""
        logits = self.lm_head(hidden[..., : self.config.hidden_size])
        return logits.float() if float32 else logits

    def greedy_ids(self, hidden: torch.Tensor, mask: TokenMask | None = None) -> torch.Tensor:
        """compute_logits(hidden).argmax(-1), without the logits where the fused kernel runs.
        `mask` (rows, bitmask): of the logits grammar-masked as `kernels.token_mask.mask_rows` does,
        hidden's rows read as [R, K1] (kernels/linear.py `TokenMask`)."""
        return linear_argmax(hidden[..., : self.config.hidden_size], self.lm_head.weight, mask=mask)

    def mtp_forward(self, next_ids, positions, h_prev, kv_cache, meta, backend) -> torch.Tensor:
        """MTP at each position: (target hidden there, the token after it) -> pre-norm hidden.
        `h_prev` is the target's `forward` output, or the MTP's own for a chained draft (no
        features: their part of `eh_proj` is skipped, as if they were zero)."""
        assert self.mtp is not None, "model was built without an MTP module"
        m, size = self.mtp, self.config.hidden_size
        table = self.model.embed_tokens.weight
        if h_prev.shape[-1] == size and type(self.model.embed_tokens) is nn.Embedding \
                and use_triton(table, h_prev, next_ids):  # the gather and both norms in one launch
            x = mtp_input(next_ids, table, h_prev.to(table.dtype), m.enorm.spec, m.hnorm.spec)
        else:
            x = self._mtp_input(next_ids, h_prev)
        weight = m.eh_proj.weight if x.shape[-1] > 2 * size else m.eh_proj.weight[:, : 2 * size]
        # with its rows' sums of squares: the block's (folded) input norm then runs inside its q/k/v GEMM
        return m.block(positions, linear(x, weight, m.eh_proj.bias, sumsq=True), kv_cache, meta, backend)

    def _mtp_input(self, next_ids: torch.Tensor, h_prev: torch.Tensor) -> torch.Tensor:
        """eh_proj's input [R, (2 + F) * hidden]: enorm(embed(next_ids)), hnorm(h), fnorm(features)."""
        assert self.mtp is not None
        m, size = self.mtp, self.config.hidden_size
        emb = self.model.embed_tokens(next_ids)
        parts = [emb, *h_prev.to(emb.dtype).split(size, dim=-1)]  # the token, the hidden, any features
        x = torch.empty(emb.shape[0], len(parts) * size, dtype=torch.promote_types(m.enorm.weight.dtype, emb.dtype),
                        device=emb.device)  # eh_proj's input: each norm writes its block of it, no cat
        for i, (norm, part) in enumerate(zip([m.enorm, m.hnorm, *m.fnorms], parts, strict=False)):
            norm(part, out=x[:, i * size : (i + 1) * size])
        return x

    def mtp_logits(self, mtp_hidden: torch.Tensor, head_weight: torch.Tensor | None = None,
                   float32: bool = True) -> torch.Tensor:
        """Draft logits [R, V]; or [R, N] over the LM head rows `head_weight` [N, hidden] of a
        draft vocabulary (engine/spec_decode/draft_vocab.py). `float32=False` keeps the model dtype (drafting
        takes an argmax, or casts itself before sampling)."""
        assert self.mtp is not None
        h = self.mtp.shared_head.norm(mtp_hidden)
        logits = self.lm_head(h) if head_weight is None else linear(h, head_weight)
        return logits.float() if float32 else logits

    def mtp_greedy_ids(self, mtp_hidden: torch.Tensor, head_weight: torch.Tensor | None = None,
                       id_map: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """mtp_logits(...).argmax(-1) (ids into `head_weight`'s rows when given, mapped through
        `id_map`, written into `out` when given), the head's norm and the argmax inside the
        LM-head GEMM where the fused kernel runs."""
        assert self.mtp is not None
        weight = self.lm_head.weight if head_weight is None else head_weight
        return linear_argmax(mtp_hidden, weight, norm=self.mtp.shared_head.norm.spec, id_map=id_map, out=out)


def fuse_projections(model: CausalLM) -> None:
    """One GEMM for q/k/v and one for gate/up in every layer (the MTP block's too).

    The fused weight is a new tensor and the original parameters become views into it, so
    no memory is duplicated and the names still load. For inference only (the runner on a GPU).

    Then each layer's two norms are folded into the GEMMs that read them (`fold_norms`):
    norm(x) @ w.T = rstd(x) * (x @ (w * g).T), so the q/k/v and gate/up kernels apply rstd(x) in
    their epilogue, from the row sums of squares that the residual GEMM which wrote x left
    (kernels/linear.py), and no norm kernel runs there: a short prefill or a decode step is
    launch-bound, and these are two launches a layer. Where x has no such sums, a weightless norm
    kernel runs. Weights loaded afterwards would miss the fold: load first.
    """
    layers: list[DecoderLayer] = [*model.model.layers]  # type: ignore[list-item]
    if model.mtp is not None:
        layers.append(model.mtp.block)
    with torch.no_grad():
        for layer in layers:
            a, m = layer.self_attn, layer.mlp
            if a.qkv is not None:
                continue  # already fused
            qkv = (a.q_proj, a.k_proj, a.v_proj)
            weight = _fuse(qkv, "weight")
            assert weight is not None
            a.qkv = (weight, _fuse(qkv, "bias"))
            m.gate_up = _fuse((m.gate_proj, m.up_proj), "weight")
        for layer in layers:
            fold_norms(layer)


def fold_norms(layer: DecoderLayer) -> None:
    """Multiply the layer's input and post-attention norm weights into the columns of its fused
    q/k/v and gate/up weights (in place, rounded to their dtype) and mark the norms folded;
    done once (a re-fused layer keeps its fold)."""
    a, m = layer.self_attn, layer.mlp
    assert a.qkv is not None and m.gate_up is not None, "fold after fusing"
    for norm, weight in ((layer.input_layernorm, a.qkv[0]), (layer.post_attention_layernorm, m.gate_up)):
        if not norm.folded:
            weight.mul_(norm.weight.to(weight.dtype)[None, :])
            norm.folded = True


def _fuse(linears: tuple[nn.Linear, ...], attr: str) -> torch.Tensor | None:
    """Concatenate the linears' `attr` (weight or bias) along rows; they become views into it."""
    parts = [getattr(lin, attr) for lin in linears]
    if parts[0] is None:
        return None
    fused = torch.cat(parts, dim=0)
    start = 0
    for lin, part in zip(linears, parts, strict=True):
        setattr(lin, attr, nn.Parameter(fused[start : start + part.shape[0]], requires_grad=False))
        start += part.shape[0]
    return fused


MTP_BLOCK_PARTS = ("self_attn.", "mlp.", "input_layernorm.", "post_attention_layernorm.")
MTP_OWN_PARTS = ("enorm.", "hnorm.", "fnorms.", "eh_proj.", "shared_head.norm.")
MTP_SHARED_PARTS = ("embed_tokens.", "shared_head.head.")


def mtp_key_to_module(key: str) -> str | None:
    """DeepSeek-style MTP key (prefix already stripped) -> our `mtp.*` name; None if shared."""
    if key.startswith(MTP_BLOCK_PARTS):
        return "mtp.block." + key
    if key.startswith(MTP_OWN_PARTS):
        return "mtp." + key
    if key.startswith(MTP_SHARED_PARTS):
        return None
    raise ValueError(f"unexpected MTP weight {key!r}")


def split_mtp_tensors(
    tensors: dict[str, torch.Tensor], num_layers: int
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Split a checkpoint into target weights and MTP weights stored at layers.{num_layers}."""
    prefix = f"model.layers.{num_layers}."
    target = {k: v for k, v in tensors.items() if not k.startswith(prefix)}
    mtp = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
    return target, mtp


def mtp_state_dict(model: CausalLM) -> dict[str, torch.Tensor]:
    """The MTP module's weights in DeepSeek form (no prefix), ready for `save_file`."""
    assert model.mtp is not None
    out = {}
    for name, tensor in model.mtp.state_dict().items():
        key = name[len("block.") :] if name.startswith("block.") else name
        out[key] = tensor.detach().contiguous()
    return out


def load_weights(model: CausalLM, target: dict[str, torch.Tensor], mtp: dict[str, torch.Tensor]) -> None:
    """Copy HF-named target tensors and DeepSeek-form MTP tensors into the model; strict."""
    params = dict(model.named_parameters(remove_duplicate=False))
    expected = {n for n in params if not n.startswith("mtp.")}
    if model.config.tie_word_embeddings:
        expected.discard("lm_head.weight")
    missing = expected - set(target)
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} weights, e.g. {sorted(missing)[:3]}")
    named = dict(target)
    if model.mtp is not None and mtp:
        for key, value in mtp.items():
            dest = mtp_key_to_module(key)
            if dest is not None:
                named[dest] = value
    with torch.no_grad():
        for name, value in named.items():
            if name not in params:
                if name == "lm_head.weight" and model.config.tie_word_embeddings:
                    continue
                raise ValueError(f"checkpoint has unexpected weight {name!r}")
            p = params[name]
            if tuple(p.shape) != tuple(value.shape):
                raise ValueError(f"shape mismatch for {name}: {tuple(value.shape)} vs {tuple(p.shape)}")
            p.copy_(value)
