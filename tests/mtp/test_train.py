"""MTP self-distillation: the training forward equals the engine's paged path, training lowers the
loss on `tiny`, the saved head loads back bit-exactly, and the shipped SmolLM2 head keeps greedy
MTP output equal to plain decoding (I1)."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.cache.kv_cache import KVCache
from engine.engine import EngineConfig, LLMEngine
from engine.model.attention import AttentionMetadata, TorchAttention
from engine.model.llama import mtp_state_dict
from engine.model.loader import load_model, mtp_path_default
from engine.model.tiny import random_tensors
from engine.sampling.sampling_params import SamplingParams
from mtp import train as train_mtp
from mtp.data import (
    DataConfig,
    generate_data,
    keep_self_prompt,
    load_data,
    save_data,
    self_prompts,
    user_turn_prefix,
)
from mtp.dense_sampler import DenseSampler, sample_dense
from mtp.files import save_head, write_line_png
from mtp.forward import chain_mask, mtp_chain, shift_left, target_hidden
from mtp.loop import (
    TrainConfig,
    answer_marker,
    answer_starts,
    evaluate,
    grow_head,
    init_head,
    prepare_for_training,
    train,
)
from mtp.prompts import HELDOUT_PROMPTS, chat_ids, read_prompts, training_prompts
from tests.engine.conftest import DEVICE

BS = 16


def paged_meta(positions: list[int], num_blocks: int) -> AttentionMetadata:
    """One row whose block i is block i+1 of the cache (block 0 is the trash block)."""
    t = lambda x: torch.tensor(x, dtype=torch.long, device=DEVICE)  # noqa: E731
    slots = [(p // BS + 1) * BS + p % BS for p in positions]
    table = [[b + 1 for b in range(num_blocks)]]
    return AttentionMetadata(t(slots), t(positions), t(table), t([0] * len(positions)),
                             t(list(range(len(positions)))), len(positions), num_blocks)


def featured_tiny():
    """`tiny` whose MTP head also reads target layer 0 and has a wider MLP, all weights random
    (so the feature path carries weight)."""
    loaded = load_model("tiny", device=DEVICE, dtype="float32")
    grow_head(loaded.model, 192, (0,), seed=3)
    assert loaded.model.mtp is not None
    loaded.model.mtp.load_state_dict(random_tensors(loaded.model.mtp, 7))
    return loaded


@pytest.mark.parametrize("head", ["deepseek form", "features and wider MLP"])
def test_training_forward_matches_the_paged_engine_path(tiny, head):
    if head != "deepseek form":
        tiny = featured_tiny()
    model, cfg = tiny.model, tiny.model.config
    n, levels = 21, 3
    ids = torch.randint(0, cfg.vocab_size, (1, n), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    dense_h = target_hidden(model, ids)
    with torch.no_grad():
        chain = mtp_chain(model, ids, dense_h, levels)
    nb = -(-(n + levels) // BS)
    kv = KVCache(cfg.num_hidden_layers + 1, nb + 1, BS, cfg.num_key_value_heads, cfg.head_dim, torch.float32, DEVICE)
    backend, meta = TorchAttention(), paged_meta(list(range(n)), nb)
    paged_h = model(ids[0], meta.positions, kv.layers, meta, backend)
    torch.testing.assert_close(dense_h[0], paged_h, rtol=1e-4, atol=1e-4)
    mtp_cache = kv.layers[-1]
    for p in (0, 7, n - levels - 1):
        h = model.mtp_forward(shift_left(ids, 1)[0], meta.positions, paged_h, mtp_cache, meta, backend)[p]
        torch.testing.assert_close(chain[0][0, p], h, rtol=1e-4, atol=1e-4)
        for j in range(2, levels + 1):  # the engine's chain step j: position p+j-1, token at p+j
            m = paged_meta([p + j - 1], nb)
            h = model.mtp_forward(ids[0, p + j : p + j + 1], m.positions, h.unsqueeze(0), mtp_cache, m, backend)[0]
            torch.testing.assert_close(chain[j - 1][0, p], h, rtol=1e-4, atol=1e-4)


def tiny_sequences(loaded, tokens: int) -> list[list[int]]:
    prompts = ["hello there", "the quick brown fox", "pdserve", "a b c d e", "once upon a time"]
    cfg = DataConfig(tokens=tokens, max_new_tokens=32, seed=1, max_num_seqs=8)
    return generate_data(loaded, prompts, cfg, DEVICE)


def test_training_lowers_the_loss_and_the_head_loads_back_bit_exactly(tmp_path):
    loaded = load_model("tiny", device=DEVICE, dtype="float32")
    seqs = tiny_sequences(loaded, 400)
    assert sum(len(s) for s in seqs) >= 400
    cfg = TrainConfig(steps=25, levels=2, lr=3e-3, batch_tokens=512, max_len=96, log_every=5)
    prepare_for_training(loaded.model)
    init_head(loaded.model, cfg.seed)
    before = evaluate(loaded.model, seqs, cfg, DEVICE)
    state = train(loaded.model, seqs, cfg, DEVICE, None, resume=False)
    after = evaluate(loaded.model, seqs, cfg, DEVICE)
    assert state.step == 25
    assert sum(after["kl"]) < 0.8 * sum(before["kl"]), (before, after)

    for dtype in (torch.float32, torch.bfloat16):
        path = tmp_path / f"head-{dtype}.safetensors"
        saved = save_head(loaded.model, path, dtype, {"note": "test"})
        back = load_model("tiny", device=DEVICE, dtype="float32", mtp_path=str(path))
        assert back.mtp_trained
        for key, value in mtp_state_dict(back.model).items():
            assert torch.equal(value.cpu(), saved[key].float()), key
        if dtype == torch.float32:
            for key, value in mtp_state_dict(loaded.model).items():
                assert torch.equal(value.cpu(), saved[key]), key


def test_train_mtp_command_writes_the_head_and_its_report(tmp_path):
    out = tmp_path / "head.safetensors"
    args = ["--model", "tiny", "--out", str(out), "--tokens", "300", "--steps", "4", "--batch-tokens", "256",
            "--max-len", "64", "--max-new-tokens", "24", "--levels", "2"]
    parser = argparse.ArgumentParser()
    train_mtp.add_arguments(parser)
    assert train_mtp.run(parser.parse_args(args)) == 0
    report = json.loads(out.with_suffix(".loss.json").read_text())
    assert report["steps"] == 4 and report["tokens"] >= 300
    assert len(report["heldout_agree"]) == 2 and all(0 <= a <= 1 for a in report["heldout_agree"])
    assert load_model("tiny", device=DEVICE, dtype="float32", mtp_path=str(out)).mtp_trained
    assert out.with_suffix(".loss.png").read_bytes()[:4] == b"\x89PNG"


def test_grown_head_computes_what_it_grew_from():
    loaded = load_model("tiny", device=DEVICE, dtype="float32")
    model = loaded.model
    ids = torch.randint(0, model.config.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    with torch.no_grad():
        before = mtp_chain(model, ids, target_hidden(model, ids), 3)
    grow_head(model, 256, (0,), seed=5)
    assert model.config.mtp_mlp_size == 256 and model.config.mtp_feature_layers == (0,)
    hidden = target_hidden(model, ids)
    assert hidden.shape[-1] == 2 * model.config.hidden_size
    with torch.no_grad():
        after = mtp_chain(model, ids, hidden, 3)
    for a, b in zip(before, after, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="feature layers"):
        grow_head(model, 0, (1,), seed=5)  # the last layer's output is the final hidden state


def test_head_with_features_trains_saves_loads_back_and_keeps_greedy_exact(tmp_path):
    out = tmp_path / "head.safetensors"
    args = ["--model", "tiny", "--out", str(out), "--tokens", "300", "--steps", "6", "--batch-tokens", "256",
            "--max-len", "64", "--max-new-tokens", "24", "--levels", "2", "--lr", "1e-2",
            "--mtp-intermediate", "192", "--feature-layers", "0"]
    parser = argparse.ArgumentParser()
    train_mtp.add_arguments(parser)
    assert train_mtp.run(parser.parse_args(args)) == 0
    back = load_model("tiny", device=DEVICE, dtype="float32", mtp_path=str(out))
    assert back.model.config.mtp_feature_layers == (0,) and back.model.config.mtp_mlp_size == 192
    saved = load_file(str(out))
    state = mtp_state_dict(back.model)
    assert set(state) == set(saved)
    for key, value in state.items():
        assert torch.equal(value.cpu(), saved[key].float()), key
    size = back.model.config.hidden_size
    assert saved["eh_proj.weight"][:, 2 * size :].abs().sum() > 0  # training reached the feature inputs
    unnamed = tmp_path / "no-metadata.safetensors"
    save_file(saved, str(unnamed))  # the tensors without the list of layers they read
    with pytest.raises(ValueError, match="1 feature norms but names 0 feature layers"):
        load_model("tiny", device=DEVICE, dtype="float32", mtp_path=str(unnamed))
    prompts = [list(b"the quick brown fox"), list(b"once upon")]
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    plain = LLMEngine(back, EngineConfig(num_speculative_tokens=0, device=DEVICE)).generate(prompts, params)
    spec = LLMEngine(back, EngineConfig(num_speculative_tokens=3, device=DEVICE)).generate(prompts, params)
    assert [r.output_ids for r in spec] == [r.output_ids for r in plain]


def test_training_resumes_from_its_checkpoint(tmp_path):
    loaded = load_model("tiny", device=DEVICE, dtype="float32")
    seqs = tiny_sequences(loaded, 150)
    ckpt = tmp_path / "head.ckpt.pt"
    cfg = TrainConfig(steps=6, levels=2, batch_tokens=256, max_len=64, log_every=1)
    train(loaded.model, seqs, TrainConfig(**{**cfg.__dict__, "steps": 3}), DEVICE, ckpt, resume=False)
    state = train(loaded.model, seqs, cfg, DEVICE, ckpt, resume=True)
    assert state.step == 6
    assert [h["step"] for h in state.history] == [1, 2, 3, 4, 5, 6]


def test_dense_sampler_greedy_equals_the_engine(tiny):
    prompts = [[256, 72, 105], [256, *range(65, 90)], [256, 10]]
    dense = sample_dense(tiny.model, prompts, [0.0] * 3, 20, (), seed=0)
    engine = LLMEngine(tiny, EngineConfig(device=DEVICE)).generate(prompts, SamplingParams(max_tokens=20, ignore_eos=True))
    assert dense == [r.prompt + r.output_ids for r in engine]
    sampled = sample_dense(tiny.model, prompts, [1.0] * 3, 20, (257,), seed=0)
    assert all(s[: len(p)] == p and len(p) < len(s) <= len(p) + 20 for s, p in zip(sampled, prompts, strict=True))


def test_dense_sampler_reused_across_waves_stays_exact(tiny):
    """A second, shorter wave in the same sampler (idle rows, stale K/V from the first wave in
    the cache, decode spans crossing a SPAN boundary) still equals the engine."""
    sampler = DenseSampler(tiny.model, 4, 100)
    params = SamplingParams(max_tokens=70, ignore_eos=True)
    engine = LLMEngine(tiny, EngineConfig(device=DEVICE))
    for wave in ([[256, *range(65, 90)], [256, 72, 105], [256, 10], [256, *range(97, 110)]], [[256, 33], [256, 40, 41]]):
        dense = sampler.sample(wave, [0.0] * len(wave), 70, (), seed=0)
        assert dense == [r.prompt + r.output_ids for r in engine.generate(wave, params)]
    with pytest.raises(ValueError, match="do not fit"):
        sampler.sample([[1] * 40], [0.0], 70, (), seed=0)


def test_data_file_round_trips_and_loss_png_is_written(tmp_path):
    seqs = [[1, 2, 3, 4], [5, 6, 7, 8, 9, 10]]
    save_data(seqs, tmp_path / "d.safetensors")
    assert load_data(tmp_path / "d.safetensors") == seqs
    png = tmp_path / "curve.png"
    write_line_png(png, [1, 2, 3], [[3.0, 2.0, 1.0], [4.0, 3.0, 2.5]])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_chain_mask_matches_what_the_engine_cache_holds():
    m = chain_mask(3, 4, torch.device("cpu"))
    assert m.shape == (4, 12)
    assert m[2, :4].tolist() == [True, True, True, False]  # level-1 keys 0..i
    assert m[2, 4:8].tolist() == [False, False, True, False]  # level-2 key of index i
    assert m[2, 8:].tolist() == [False, False, True, False]  # level-3 key of index i


def test_loss_counts_answer_positions_only():
    ids = torch.tensor([[5, 1, 2, 9, 1, 2, 7, 8], [3, 3, 3, 3, 3, 3, 3, 3], [1, 2, 4, 4, 4, 4, 1, 2]])
    assert answer_starts(ids, (1, 2)).tolist() == [6, 0, 8]
    assert answer_starts(ids, ()).tolist() == [0, 0, 0]


@pytest.mark.smollm2
def test_answer_marker_is_the_assistant_turn_opener(smollm2):
    smollm2_tokenizer = smollm2.tokenizer
    marker = answer_marker(smollm2_tokenizer)
    assert smollm2_tokenizer.decode(list(marker), skip_special_tokens=False) == "<|im_start|>assistant\n"
    ids = torch.tensor([chat_ids(smollm2_tokenizer, "hi") + [42, 43]])
    assert answer_starts(ids, marker).tolist() == [ids.shape[1] - 2]


def test_heldout_prompts_are_not_training_prompts():
    held = set(read_prompts(HELDOUT_PROMPTS))
    train = set(training_prompts(0, 0))
    assert len(held) >= 12
    assert not held & train


@pytest.mark.smollm2
def test_shipped_smollm2_head_loads_by_default_and_keeps_greedy_exact(smollm2):
    assert mtp_path_default("smollm2") is not None and smollm2.mtp_trained
    prompts = [chat_ids(smollm2.tokenizer, p) for p in read_prompts(HELDOUT_PROMPTS)[:3]]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    plain = LLMEngine(smollm2, EngineConfig(num_speculative_tokens=0, device=DEVICE)).generate(prompts, params)
    spec = LLMEngine(smollm2, EngineConfig(num_speculative_tokens=3, device=DEVICE)).generate(prompts, params)
    assert [r.output_ids for r in spec] == [r.output_ids for r in plain]
    steps = sum(r.steps for r in spec)
    assert sum(len(r.output_ids) - 1 for r in spec) / steps > 1.2  # an untrained head gives ~1.0


def test_self_prompt_filter():
    assert keep_self_prompt("  How do I delete cookies from my browser?  ")
    assert not keep_self_prompt("Hi there")  # too short
    assert not keep_self_prompt("word " * 100)  # too long
    assert not keep_self_prompt("Frozen Elix yak Potassium đồng Joi đồng Joi ? ?")  # not plain text


def test_self_prompts_need_a_chat_template(tiny):
    with pytest.raises(ValueError, match="chat template"):
        user_turn_prefix(tiny.tokenizer)


@pytest.mark.smollm2
def test_smollm2_writes_its_own_user_requests(smollm2):
    prefix = smollm2.tokenizer.decode(user_turn_prefix(smollm2.tokenizer), skip_special_tokens=False)
    assert prefix.endswith("<|im_start|>user\n") and "<|im_start|>system" in prefix
    prompts = self_prompts(smollm2, 3, DataConfig(tokens=1, max_num_seqs=6, seed=3, seconds=120), max_new=64)
    held = set(read_prompts(HELDOUT_PROMPTS))
    assert prompts and len(set(prompts)) == len(prompts)
    assert all(keep_self_prompt(p) and p not in held for p in prompts)
