"""Our Llama-family model equals transformers' on the same random weights (fp32, 1e-4 relative),
for prefill and for step-by-step decode through the paged cache with scattered blocks."""

from __future__ import annotations

import random

import pytest
import torch
import transformers

from engine.cache.kv_cache import KVCache
from engine.model.attention import TRASH_BLOCK, AttentionMetadata, TorchAttention
from engine.model.config import ArchConfig
from engine.model.llama import load_weights
from engine.model.loader import build_model

BLOCK = 4
CONFIGS = {
    "llama3": dict(
        model_type="llama", vocab_size=97, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=6, num_key_value_heads=2, head_dim=8, rope_theta=500000.0,
        max_position_embeddings=256, tie_word_embeddings=False, rms_norm_eps=1e-5,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
    ),
    "smollm2": dict(
        model_type="llama", vocab_size=101, hidden_size=36, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=3, num_key_value_heads=1, rope_theta=100000.0,
        max_position_embeddings=256, tie_word_embeddings=True, rms_norm_eps=1e-5,
    ),
    "qwen2": dict(
        model_type="qwen2", vocab_size=89, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, rope_theta=1000000.0,
        max_position_embeddings=256, tie_word_embeddings=False, rms_norm_eps=1e-6,
    ),
    "qwen3": dict(
        model_type="qwen3", vocab_size=91, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=1000000.0,
        max_position_embeddings=256, tie_word_embeddings=True, rms_norm_eps=1e-6,
    ),
}
HF_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def make_pair(name: str):
    d = CONFIGS[name]
    cfg_cls = getattr(transformers, HF_CLASSES[d["model_type"]].replace("ForCausalLM", "Config"))
    hf_cfg = cfg_cls(**{k: v for k, v in d.items() if k != "model_type"}, attn_implementation="eager")
    torch.manual_seed(0)
    hf = getattr(transformers, HF_CLASSES[d["model_type"]])(hf_cfg).eval()
    with torch.no_grad():  # spread the weights so differences show
        for p in hf.parameters():
            p.add_(0.05 * torch.randn_like(p))
    ours_cfg = ArchConfig.from_hf_dict(hf_cfg.to_dict() | {"model_type": d["model_type"]})
    ours = build_model(ours_cfg, with_mtp=False)
    load_weights(ours, dict(hf.state_dict()), {})
    return hf, ours.eval()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


class PagedRunner:
    """Feeds several sequences through the model chunk by chunk, like the engine does."""

    def __init__(self, model, num_seqs: int, seed: int) -> None:
        c = model.config
        self.model, self.backend = model, TorchAttention()
        self.cache = KVCache(c.num_hidden_layers, 64, BLOCK, c.num_key_value_heads, c.head_dim, torch.float32, "cpu")
        ids = list(range(1, 64))
        random.Random(seed).shuffle(ids)
        self.tables = [ids[i * 10 : (i + 1) * 10] for i in range(num_seqs)]

    def run(self, pieces: list[tuple[int, list[int], int]]) -> torch.Tensor:
        """pieces: (seq index, token ids, start position). Returns logits [T, V]."""
        ids, pos, slots, rows, cols = [], [], [], [], []
        for r, (s, toks, start) in enumerate(pieces):
            for j, t in enumerate(toks):
                p = start + j
                ids.append(t)
                pos.append(p)
                slots.append(self.tables[s][p // BLOCK] * BLOCK + p % BLOCK)
                rows.append(r)
                cols.append(j)
        tables = [self.tables[s] for s, _, _ in pieces]
        L = torch.tensor
        meta = AttentionMetadata(L(slots), L(pos), L(tables), L(rows), L(cols),
                                 max(len(t) for _, t, _ in pieces), 10)
        with torch.no_grad():
            hidden = self.model(L(ids), meta.positions, self.cache.layers, meta, self.backend)
            return self.model.compute_logits(hidden)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_prefill_logits_match_transformers(name):
    hf, ours = make_pair(name)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, ours.config.vocab_size, (n,), generator=g).tolist() for n in (13, 7)]
    runner = PagedRunner(ours, 2, seed=5)
    logits = runner.run([(0, seqs[0], 0), (1, seqs[1], 0)])
    with torch.no_grad():
        ref = [hf(torch.tensor([s])).logits[0] for s in seqs]
    assert rel_err(logits[:13], ref[0]) < 1e-4
    assert rel_err(logits[13:], ref[1]) < 1e-4


@pytest.mark.parametrize("name", list(CONFIGS))
def test_paged_decode_matches_transformers(name):
    """Chunked prefill, then one token per step and a 3-token verify block, blocks scattered."""
    hf, ours = make_pair(name)
    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, ours.config.vocab_size, (n,), generator=g).tolist() for n in (30, 22)]
    with torch.no_grad():
        ref = [hf(torch.tensor([s])).logits[0] for s in seqs]
    runner = PagedRunner(ours, 2, seed=9)
    runner.run([(0, seqs[0][:6], 0), (1, seqs[1][:9], 0)])
    runner.run([(0, seqs[0][6:11], 6), (1, seqs[1][9:10], 9)])
    for p0, p1 in zip(range(11, 20), range(10, 19), strict=True):
        out = runner.run([(0, [seqs[0][p0]], p0), (1, [seqs[1][p1]], p1)])
        assert rel_err(out[0], ref[0][p0]) < 1e-4
        assert rel_err(out[1], ref[1][p1]) < 1e-4
    out = runner.run([(0, seqs[0][20:23], 20), (1, seqs[1][19:22], 19)])
    assert rel_err(out[:3], ref[0][20:23]) < 1e-4
    assert rel_err(out[3:], ref[1][19:22]) < 1e-4


def test_trash_block_is_never_allocated_to_tables():
    hf, ours = make_pair("smollm2")
    runner = PagedRunner(ours, 2, seed=0)
    assert all(TRASH_BLOCK not in t for t in runner.tables)



def test_fused_and_folded_projections_match_transformers():
    """fuse_projections folds each layer's two norm weights into the q/k/v and gate/up weights
    (the GEMMs then normalize x themselves): the logits stay HF's; fusing again (as tensor
    parallelism re-fuses) does not fold twice."""
    from engine.model.llama import fuse_projections

    hf, ours = make_pair("qwen2")  # q/k/v biases: the bias is added after the norm's scale
    fuse_projections(ours)
    layer = ours.model.layers[0]
    assert layer.input_layernorm.folded and layer.post_attention_layernorm.folded
    assert layer.input_layernorm.spec[0] is None
    once = layer.self_attn.qkv[0].clone()
    layer.self_attn.qkv, layer.mlp.gate_up = None, None  # unfused, as tensor parallelism leaves it
    fuse_projections(ours)
    assert torch.equal(layer.self_attn.qkv[0], once)
    seq = torch.randint(0, ours.config.vocab_size, (13,), generator=torch.Generator().manual_seed(1)).tolist()
    logits = PagedRunner(ours, 1, seed=5).run([(0, seq, 0)])
    with torch.no_grad():
        assert rel_err(logits, hf(torch.tensor([seq])).logits[0]) < 1e-4
