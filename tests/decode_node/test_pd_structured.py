"""Structured output through PrefillNode + DecodeNode (plain objects, kvtransfer `local`) and the
ColocatedNode: the prefill node samples the first token under the grammar, the decode node
rebuilds the grammar state from (spec, emitted tokens) and goes on; output equals the
single-process engine's, MTP or not, a constrained request beside an unconstrained one; a spec
that does not compile ends with one error."""

from __future__ import annotations

import pytest

from engine.engine import EngineConfig, LLMEngine
from engine.grammar.structured import StructuredSpec
from engine.model.loader import load_model
from engine.sampling.sampling_params import SamplingParams
from tests.decode_node.test_pd_nodes import Pair, reference, wait_until

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                          "maximum": 9},
                                           "tag": {"type": "string", "maxLength": 4}},
          "required": ["ok", "n", "tag"]}


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny")


@pytest.mark.parametrize("k", [0, 3])
def test_pd_constrained_greedy_equals_single_process(tiny, k):
    vocab = tiny.model.config.vocab_size
    prompts = [[5, 6, 7, 8], [9] * 23, [1, 2, 3]]
    params = [SamplingParams(max_tokens=80, structured=StructuredSpec.json_schema(SCHEMA)),
              SamplingParams(max_tokens=40, structured=StructuredSpec("regex", "[a-z]{2,5}=[0-9]{1,3}")),
              SamplingParams(max_tokens=20, ignore_eos=True)]
    want = reference(tiny, prompts, params)
    assert want[0][-1] in tiny.eos_token_ids and want[1][-1] in tiny.eos_token_ids  # the grammars ended them
    pair = Pair(tiny, k)
    try:
        firsts = [pair.run(f"s{i}", p, sp, vocab) for i, (p, sp) in enumerate(zip(prompts, params, strict=True))]
        pair.wait_terminal([f"s{i}" for i in range(len(prompts))])
        assert [pair.tokens(f"s{i}", f) for i, f in enumerate(firsts)] == want
        assert not any(it.error for items in pair.outputs.values() for it in items)
    finally:
        pair.close()
    assert pair.decode.blocks.num_free == pair.decode.blocks.capacity
    assert pair.prefill.blocks.num_free == pair.prefill.blocks.capacity


def test_pd_spec_that_does_not_compile_ends_with_one_error(tiny):
    """Nothing upstream checked the spec: the prefill node samples the first token unmasked, the
    decode node's insert fails to compile the grammar and sends one terminal error."""
    params = SamplingParams(max_tokens=10, structured=StructuredSpec("regex", "(ab"))
    pair = Pair(tiny, 2)
    try:
        pair.run("bad", [5, 6, 7], params, tiny.model.config.vocab_size)
        pair.wait_terminal(["bad"])
        ends = [it for it in pair.outputs["bad"] if it.finish_reason or it.error]
        assert len(ends) == 1 and ends[0].finish_reason is None
        assert ends[0].error is not None and "structured output regex does not compile" in ends[0].error
        wait_until(lambda: pair.prefill.blocks.num_free == pair.prefill.blocks.capacity)  # P lets go once D has the KV
    finally:
        pair.close()
    assert pair.decode.blocks.num_free == pair.decode.blocks.capacity
    assert pair.prefill.blocks.num_free == pair.prefill.blocks.capacity


@pytest.mark.parametrize("k", [0, 3])
def test_colocated_constrained_equals_single_process(tiny, k):
    from tests.decode_node.test_colocated_node import Colocated

    node = Colocated(tiny, k)
    prompts = [[5, 6, 7, 8], [9] * 40, [1, 2, 3]]  # 40 tokens: a prompt in chunks, beside running requests
    params = [SamplingParams(max_tokens=80, n=2, temperature=1.0, seed=3, structured=StructuredSpec.json_schema(SCHEMA)),
              SamplingParams(max_tokens=40, structured=StructuredSpec("regex", "[a-z]{2,5}=[0-9]{1,3}")),
              SamplingParams(max_tokens=20, ignore_eos=True)]
    try:
        for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
            node.submit(f"c{i}", p, sp)
        node.wait(lambda: all(sum(1 for it in node.of(f"c{i}") if it.finish_reason or it.error) == sp.n
                              for i, sp in enumerate(params)))
        want = LLMEngine(tiny, EngineConfig(num_speculative_tokens=k)).generate(prompts, params)  # same k: sampled
        for i, r in enumerate(want):
            for choice in (r, *r.children):
                got = [t for it in node.of(f"c{i}") if it.index == choice.index for t in it.tokens]
                assert got == choice.output_ids
        assert not any(it.error for it in node.items)
        node.wait(lambda: node.node.blocks.num_free == node.start_free)
    finally:
        node.node.stop()
