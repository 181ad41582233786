"""The fast GGUF load path (engine.model.gguf_file + torch dequantization on the model's device +
`empty_model`) gives the model the old path gave (gguf's reader, gguf's numpy dequantization
to fp32 host tensors, an fp32 model cast by `_materialize`): every parameter and buffer bit
for bit, the same tied weights, and so the same greedy tokens and logprobs, fp32 and bf16.
On a GPU machine: PDSERVE_TEST_DEVICE=cuda PDSERVE_TEST_GGUF=/tmp/smollm2.gguf."""

from __future__ import annotations

import dataclasses
import os

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize

from engine.engine import EngineConfig, LLMEngine
from engine.model import gguf_loader, gguf_meta
from engine.model.config import ArchConfig
from engine.model.llama import load_weights, split_mtp_tensors
from engine.model.loader import (
    _materialize,
    build_model,
    empty_model,
    head_config,
    load_model,
    mtp_path_default,
    read_head,
    served_name,
)
from engine.model.paths import resolve_model
from engine.model.tiny import tiny_config
from engine.sampling.sampling_params import SamplingParams

from .conftest import DEVICE


def old_tensors(path: str) -> tuple[ArchConfig, dict[str, torch.Tensor]]:
    """What gguf_loader.load_gguf_tensors did before: gguf's reader and numpy, fp32 on the host."""
    config = gguf_meta.arch_config_from_gguf(gguf_meta.open_gguf(path))
    tensors = {}
    for t in gguf.GGUFReader(path).tensors:
        name = gguf_loader.hf_tensor_name(t.name)
        values = np.array(dequantize(np.asarray(t.data), t.tensor_type), dtype=np.float32)
        values = values.reshape(tuple(reversed(t.shape.tolist())))
        if ".self_attn.q_proj." in name:
            values = gguf_loader.unpermute_qk(values, config.num_attention_heads)
        elif ".self_attn.k_proj." in name:
            values = gguf_loader.unpermute_qk(values, config.num_key_value_heads)
        tensors[name] = torch.from_numpy(np.ascontiguousarray(values))
    return config, tensors


def old_model(ref: str, dtype: torch.dtype, device: str) -> torch.nn.Module:
    """What load_model(ref) built before (`ref`: a model name or a .gguf path)."""
    config, tensors = old_tensors(resolve_model(ref))
    target, mtp = split_mtp_tensors(tensors, config.num_hidden_layers)
    head = mtp_path_default(served_name(ref))
    if head is not None:
        mtp, config = read_head(head, config)
    else:
        config = head_config(config, mtp, ())
    model = build_model(config)
    load_weights(model, target, mtp)
    return _materialize(model, device, dtype)


def assert_same_module(new: torch.nn.Module, old: torch.nn.Module) -> None:
    new_state, old_state = new.state_dict(keep_vars=True), old.state_dict(keep_vars=True)
    assert list(new_state) == list(old_state)
    for name, value in old_state.items():
        ours = new_state[name]
        assert ours.dtype == value.dtype and ours.shape == value.shape, name
        assert ours.requires_grad == value.requires_grad, name
        assert torch.equal(ours.view(torch.uint8) if ours.dtype != torch.bool else ours,
                           value.view(torch.uint8) if value.dtype != torch.bool else value), name
    for (n, b), (_, ob) in zip(new.named_buffers(), old.named_buffers(), strict=True):
        assert b.dtype == ob.dtype and torch.equal(b, ob), n
    assert new.training == old.training


@pytest.mark.smollm2
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_new_load_path_gives_the_old_model_and_answers(smollm2_gguf: str, dtype: str) -> None:
    ref = os.environ.get("PDSERVE_TEST_GGUF", "smollm2")  # a path named smollm2.gguf gets the shipped head too
    new = load_model(ref, device=DEVICE, dtype=dtype)
    torch_dtype = getattr(torch, dtype)
    old = old_model(ref, torch_dtype, DEVICE)
    assert new.mtp_trained
    assert_same_module(new.model, old)
    assert new.model.lm_head.weight is new.model.model.embed_tokens.weight  # still tied
    assert new.model.rotary.cos.dtype == torch.float32

    prompt = new.tokenizer.encode("The capital of France is")
    params = SamplingParams(max_tokens=4, logprobs=20)
    answers = []
    for model in (new.model, old):
        new.model = model  # the same LoadedModel (tokenizer, EOS ids), either weights
        (req,) = LLMEngine(new, EngineConfig(max_model_len=64, device=DEVICE)).generate([prompt], params)
        answers.append((req.output_ids, [lp.to_json() for lp in req.logprobs]))
    assert answers[0] == answers[1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_empty_model_is_the_materialized_model(dtype: torch.dtype) -> None:
    """`empty_model` (built in `dtype` directly) has what `_materialize(build_model(...))` has:
    names, shapes, dtypes, the fp32 rotary tables' values, the tied head, eval mode, no grads."""
    config = dataclasses.replace(tiny_config(), tie_word_embeddings=True)
    new, old = empty_model(config, "cpu", dtype), _materialize(build_model(config), "cpu", dtype)
    new_state, old_state = new.state_dict(keep_vars=True), old.state_dict(keep_vars=True)
    assert [(n, t.shape, t.dtype, t.requires_grad) for n, t in new_state.items()] == [
        (n, t.shape, t.dtype, t.requires_grad) for n, t in old_state.items()]
    for (n, b), (_, ob) in zip(new.named_buffers(), old.named_buffers(), strict=True):
        assert b.dtype == ob.dtype == torch.float32 and torch.equal(b, ob), n
    assert new.lm_head.weight is new.model.embed_tokens.weight
    assert not new.training and torch.get_default_dtype() == torch.float32
