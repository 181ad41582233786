"""Grammar-constrained decoding (issue 28): the tokenizer's view in xgrammar, the compiler and
its errors, the mask on the logits against a per-token reference, and through the engine:
greedy output that matches its regex / choice / JSON schema, MTP (k = 3) giving exactly the
k = 0 tokens (alone and beside unconstrained requests), seeded sampling (k = 0 against a
token-by-token masked reference, k = 3 against the exact masked distribution), n > 1, a request
inserted with tokens already emitted (a decode node's first token), a moved request, errors."""

from __future__ import annotations

import json
import re
import threading
from collections import Counter

import jsonschema
import pytest
import torch

from engine.engine import EngineConfig, LLMEngine
from engine.grammar.compiler import GrammarCompiler, mask_words, tokenizer_info
from engine.grammar.structured import StructuredSpec
from engine.model.tiny import EOS_ID, ByteTokenizer, tiny_config
from engine.runner.model_runner import ModelRunner
from engine.sampling.sampler import SamplingTensors, sample
from engine.sampling.sampling_params import SamplingParams
from kernels.token_mask import mask_logits
from tests.engine.conftest import DEVICE
from tests.engine.test_engine import OracleDrafts
from tests.engine.test_penalties import full_logits

VOCAB = tiny_config().vocab_size


def bits_of(bitmask: torch.Tensor, vocab: int) -> list[list[int]]:
    """The allowed token ids of each row, one token at a time (the reference unpacking)."""
    return [[t for t in range(vocab) if (int(row[t // 32]) >> (t % 32)) & 1] for row in bitmask]


def test_mask_logits_equals_reference_on_random_bitmasks():
    g = torch.Generator().manual_seed(0)
    vocab = 77  # not a multiple of 32
    logits = torch.randn(5, vocab, generator=g)
    bitmask = torch.randint(-(2**31), 2**31, (5, mask_words(vocab)), generator=g, dtype=torch.int64).to(torch.int32)
    got = mask_logits(logits, bitmask)
    for r, ok in enumerate(bits_of(bitmask, vocab)):
        want = [x if t in ok else float("-inf") for t, x in enumerate(logits[r].tolist())]
        assert got[r].tolist() == want
    assert mask_logits(logits[None], bitmask[None]).shape == (1, 5, vocab)  # any leading dims


def tiny_compiler() -> GrammarCompiler:
    return GrammarCompiler(ByteTokenizer(), VOCAB)


def test_tiny_tokenizer_info_is_bytes_and_eos():
    info = tokenizer_info(ByteTokenizer(), VOCAB)
    assert info.vocab_size == VOCAB and info.stop_token_ids == [EOS_ID]
    assert info.decoded_vocab[65] == b"A"


def test_smollm2_tokenizer_info_reads_byte_level_tokens(smollm2_gguf):
    from engine.model.gguf_meta import arch_config_from_gguf, open_gguf
    from engine.model.tokenizer import Tokenizer

    reader = open_gguf(smollm2_gguf)
    tok, vocab = Tokenizer.from_gguf_metadata(reader), arch_config_from_gguf(reader).vocab_size
    compiler = GrammarCompiler(tok, vocab + 64)  # a model's vocabulary may exceed the tokenizer's
    m = compiler.matcher(StructuredSpec.json_schema({"type": "object", "properties": {"a": {"type": "integer"}},
                                                     "required": ["a"]}))
    for t in tok.encode('{"a": 12}'):
        assert m.accept(t)
    mask = torch.zeros(1, compiler.words, dtype=torch.int32)
    m.fill_mask(mask, 0)
    assert bits_of(mask, vocab + 64) == [list(tok.eos_token_ids)]  # the object is closed: only EOS


def test_choice_is_exactly_one_option_and_terminates_on_eos():
    m = tiny_compiler().matcher(StructuredSpec.choice(['say "yes"', "no"]))
    mask = torch.zeros(2, mask_words(VOCAB), dtype=torch.int32)
    m.fill_mask(mask, 0)
    assert bits_of(mask[:1], VOCAB) == [[ord("n"), ord("s")]]
    for t in b"no":
        assert m.accept(t)
    assert not m.accept(ord("x"))
    assert m.accept(EOS_ID) and m.is_terminated
    m.fill_mask(mask, 1)
    assert bits_of(mask[1:], VOCAB) == [[EOS_ID]]  # terminated: stop tokens only
    m.rollback(2)
    assert not m.is_terminated and m.accept(ord("o"))


@pytest.mark.parametrize("spec", [StructuredSpec("regex", "(ab"), StructuredSpec("grammar", "root ::= missing"),
                                  StructuredSpec("json_schema", '{"type": "no-such-type"}')])
def test_compile_errors_name_the_kind(spec):
    with pytest.raises(ValueError, match=f"structured output {spec.kind} does not compile"):
        tiny_compiler().compile(spec)


def test_compiler_cache_is_bounded_and_keyed_by_spec():
    c = GrammarCompiler(ByteTokenizer(), VOCAB, max_cached=2)
    a = c.compile(StructuredSpec("regex", "a+"))
    assert c.compile(StructuredSpec("regex", "a+")) is a
    c.compile(StructuredSpec("regex", "b+"))
    c.compile(StructuredSpec("regex", "c+"))
    assert len(c._cache) == 2 and c.compile(StructuredSpec("regex", "a+")) is not a


def test_threads_compile_into_one_bounded_cache():
    c = GrammarCompiler(ByteTokenizer(), VOCAB, max_cached=3)
    specs = [StructuredSpec("regex", f"[a-{chr(ord('b') + i)}]+") for i in range(6)]
    threads = [threading.Thread(target=c.precompile, args=(specs[i % 6],)) for i in range(24)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    c.precompile(StructuredSpec("regex", "(ab"))  # an error is the next compile's to raise
    assert len(c._cache) == 3 and c.matcher(specs[0], b"ab").accept(ord("a"))


def test_matcher_rejects_replayed_tokens_outside_the_grammar():
    with pytest.raises(ValueError, match="does not match the structured output regex"):
        tiny_compiler().matcher(StructuredSpec("regex", "[0-9]+"), b"12a")


@pytest.mark.parametrize("bounds", [{"maxLength": 12}, {"minLength": 1}, {}])
def test_json_strings_hold_no_raw_control_characters(bounds):
    """JSON forbids raw U+0000-U+001F in strings; xgrammar's bounded strings let them in, ours do not."""
    spec = StructuredSpec.json_schema({"type": "object", "properties": {"a": {"type": "string", **bounds}},
                                       "required": ["a"]})
    m = tiny_compiler().matcher(spec, b'{"a": "x')
    assert not any(m.accept(c) for c in range(32))
    assert m.accept(ord("y")) and m.accept(ord('"'))


# ---------------------------------------------------------------- through the engine

PROMPT = [5, 17, 5, 99, 5, 17, 200, 31]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
    },
    "required": ["name", "ok", "n", "color", "tags"],
}
REGEX = r"[a-z]{2,6}@[a-z]{1,5}\.(com|org)"
CHOICES = ["yes", "no", "maybe not"]
SPECS = {"regex": StructuredSpec("regex", REGEX), "choice": StructuredSpec.choice(CHOICES),
         "json": StructuredSpec.json_schema(SCHEMA), "json_object": StructuredSpec("json_object")}


def text_of(req) -> str:
    assert req.finish_reason == "stop" and req.output_ids[-1] == EOS_ID, (req.finish_reason, req.output_ids)
    # xgrammar's JSON strings take any code point but '"', '\\' and newlines: surrogates and raw
    # control characters too (a random model finds them), which strict Python parsing refuses
    return bytes(req.output_ids[:-1]).decode("utf-8", "surrogatepass")


def check(kind: str, text: str) -> None:
    """`text` is what the spec `kind` asks for."""
    if kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "choice":
        assert text in CHOICES
    else:
        value = json.loads(text, strict=False)
        assert isinstance(value, dict)
        if kind == "json":
            jsonschema.validate(value, SCHEMA)


def params_for(kind: str, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=kw.pop("max_tokens", 160), structured=SPECS[kind], **kw)


def engine(tiny, k: int, **kw) -> LLMEngine:
    return LLMEngine(tiny, EngineConfig(num_speculative_tokens=k, block_shuffle_seed=7, device=DEVICE, **kw))


@pytest.mark.parametrize("kind", ["regex", "choice", "json"])
def test_greedy_constrained_output_matches_its_spec(tiny, kind):
    eng = engine(tiny, 0)
    req = eng.generate([PROMPT], params_for(kind))[0]
    check(kind, text_of(req))
    assert eng.num_free_blocks == eng.blocks.capacity


def test_json_object_is_a_closed_object(tiny):
    eng = engine(tiny, 0)
    req = eng.generate([PROMPT], params_for("json_object", max_tokens=400))[0]
    if req.finish_reason == "stop":  # a random model may fill an object until max_tokens runs out
        check("json_object", text_of(req))
    else:
        assert req.finish_reason == "length" and bytes(req.output_ids)[:1] == b"{"
    assert eng.num_free_blocks == eng.blocks.capacity


def unconstrained_prompts() -> list[list[int]]:
    return [[7, 8, 9], [200, 100, 50, 25, 12]]


@pytest.mark.parametrize("drafts", ["mtp", "oracle"])
def test_greedy_mtp_equals_plain_in_a_mixed_batch(tiny, drafts, monkeypatch):
    """k = 3 equals k = 0 token for token, the steps in two halves around the masks."""
    launched = Counter()
    for name in ("launch_decode", "launch_forward"):
        real = getattr(ModelRunner, name)
        monkeypatch.setattr(ModelRunner, name, lambda self, *a, _f=real, _n=name: launched.update([_n]) or _f(self, *a))
    kinds = ["json", "regex", "choice"]
    prompts = [PROMPT, PROMPT[:5], PROMPT[2:]] + unconstrained_prompts()
    plain_p = SamplingParams(max_tokens=30, ignore_eos=True)
    params = [params_for(kind, seed=100 + i) for i, kind in enumerate(kinds)]
    params += [SamplingParams(max_tokens=30, ignore_eos=True, seed=103 + i) for i in range(2)]
    want = [r.output_ids for r in engine(tiny, 0).generate(prompts, params)]
    alone = [r.output_ids for r in engine(tiny, 0).generate(unconstrained_prompts(), plain_p)]
    assert want[3:] == alone  # a constrained neighbour changes nothing for the others
    if drafts == "oracle":  # drafts that are always right: every verify position's mask decides what is kept
        oracle = OracleDrafts({100 + i: p + w for i, (p, w) in enumerate(zip(prompts, want, strict=True))})
        monkeypatch.setattr(ModelRunner, "draft_chain", lambda self, *a: oracle(self, *a))
    eng = engine(tiny, 3)
    got = eng.generate(prompts, params)
    assert [r.output_ids for r in got] == want
    for kind, r in zip(kinds, got, strict=False):
        check(kind, text_of(r))
    if drafts == "oracle":
        assert all(r.steps < len(r.output_ids) - 1 for r in got)  # drafts were accepted
    assert launched["launch_forward"] > 0  # the constrained steps ran in halves
    assert eng.num_free_blocks == eng.blocks.capacity and not eng.batch.constrained


@pytest.mark.parametrize("k", [0, 3])
@pytest.mark.parametrize("kind", ["json", "regex", "choice"])
def test_seeded_sampling_is_constrained(tiny, k, kind):
    eng = engine(tiny, k)
    reqs = eng.generate([PROMPT, PROMPT[1:]], [params_for(kind, temperature=1.0, seed=s) for s in (5, 6)])
    for r in reqs:
        check(kind, text_of(r))
    again = engine(tiny, k).generate([PROMPT], params_for(kind, temperature=1.0, seed=5))[0]
    assert again.output_ids == reqs[0].output_ids  # the seed fixes the tokens
    assert eng.num_free_blocks == eng.blocks.capacity


def test_n_choices_each_follow_their_own_grammar(tiny):
    eng = engine(tiny, 2)
    req = eng.generate([PROMPT], params_for("choice", temperature=1.5, seed=9, n=4))[0]
    for r in (req, *req.children):
        check("choice", text_of(r))
    assert eng.num_free_blocks == eng.blocks.capacity


def test_max_tokens_ends_a_constrained_request_with_length(tiny):
    eng = engine(tiny, 3)
    req = eng.generate([PROMPT], params_for("regex", max_tokens=4))[0]
    assert req.finish_reason == "length" and len(req.output_ids) == 4
    assert eng.num_free_blocks == eng.blocks.capacity


@pytest.mark.parametrize("k", [0, 3])
def test_inserted_with_emitted_tokens_continues(tiny, k):
    """A decode node's insert: the prefill ran elsewhere; the first token and drafts arrive as host
    values, the grammar state as (spec, emitted tokens)."""
    want = engine(tiny, 0).generate([PROMPT], params_for("json"))[0].output_ids
    eng = engine(tiny, k)
    eng.add_request(PROMPT, params_for("json"))
    chunks, reqs = eng._schedule_prefill()
    out = eng.runner.prefill(chunks)  # the prefill node's part: first token sampled under the grammar
    req = reqs[0]
    eng.prefill.drop(req)
    first = int(out.first_token[0])
    req.output_ids, req.prompt = [first], []  # a decode node knows the emitted tokens, not the prompt
    eng.batch.insert(req, first, out.drafts[0].tolist() if out.drafts is not None else None, None)
    while eng.has_unfinished():
        eng.step()
    assert req.output_ids == want
    assert eng.num_free_blocks == eng.blocks.capacity


@pytest.mark.parametrize("k", [0, 3])
def test_moved_request_resumes_its_grammar_state(tiny, k):
    """A moved request: its output so far is the end of its new prompt (`resumed_tokens`); the
    grammar replays it, in prefill (the first token's mask) and in decode."""
    want = engine(tiny, 0).generate([PROMPT], params_for("json"))[0].output_ids
    cut = 9
    moved = params_for("json", resumed_tokens=cut, max_tokens=160 - cut)
    eng = engine(tiny, k)
    got = eng.generate([PROMPT + want[:cut]], moved)[0]
    assert got.output_ids == want[cut:]
    assert eng.num_free_blocks == eng.blocks.capacity


def test_a_spec_that_does_not_compile_is_refused_at_submit(tiny):
    with pytest.raises(ValueError, match="structured output regex does not compile"):
        engine(tiny, 0).add_request(PROMPT, SamplingParams(structured=StructuredSpec("regex", "(ab")))


def test_ignore_eos_with_structured_is_a_clear_error(tiny):
    """The engine refuses it; a node's params (ignore_eos with the router's stop ids, EOS among them) pass."""
    with pytest.raises(ValueError, match="ignore_eos cannot be used with structured output"):
        engine(tiny, 0).add_request(PROMPT, SamplingParams(ignore_eos=True, structured=SPECS["regex"]))
    eos = tuple(tiny.eos_token_ids)
    assert eos, "tiny has an EOS"
    engine(tiny, 0).add_request(PROMPT, SamplingParams(ignore_eos=True, stop_token_ids=eos, structured=SPECS["regex"]))


@pytest.mark.parametrize("where", ["insert", "step"])
def test_a_rejected_emitted_token_ends_the_request_with_an_error(tiny, monkeypatch, where):
    """A token the grammar refuses (a masking bug) ends its request with an error; the loop goes on."""
    if where == "insert":  # the replay of the first token fails
        monkeypatch.setattr("engine.grammar.compiler.Matcher.accept", lambda self, t: False)
    else:  # a decode step's tokens fail
        monkeypatch.setattr("engine.runner.constrained.ConstrainedRows.advance", lambda self, *a: False)
    eng = engine(tiny, 2)
    rid = eng.add_request(PROMPT, SamplingParams(max_tokens=20, structured=SPECS["regex"]))
    plain = eng.add_request(PROMPT[:4], SamplingParams(max_tokens=6, ignore_eos=True))
    outputs = []
    while eng.has_unfinished():
        outputs += eng.step()
    assert [o.finish_reason is not None for o in outputs if o.request_id == rid] == [False, True]  # one terminal
    reason = eng.requests[rid].finish_reason
    assert reason is not None and reason.startswith("error: ")
    assert ("do not match" in reason) == (where == "step")
    assert len(eng.requests[plain].output_ids) == 6
    assert eng.num_free_blocks == eng.blocks.capacity and not eng.batch.constrained


@pytest.mark.smollm2
def test_smollm2_json_schema_greedy_with_mtp_equals_plain(smollm2):
    tok = smollm2.tokenizer
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                               "country": {"enum": ["France", "Italy", "Spain"]},
                                               "population_millions": {"type": "integer", "minimum": 0,
                                                                       "maximum": 40}},
              "required": ["city", "country", "population_millions"]}
    prompt = tok.encode("The capital of France, as JSON:")
    params = SamplingParams(max_tokens=48, structured=StructuredSpec.json_schema(schema))
    outs = []
    for k in (0, 3):
        eng = LLMEngine(smollm2, EngineConfig(num_speculative_tokens=k, max_model_len=256, device=DEVICE))
        req = eng.generate([prompt], params)[0]
        assert req.finish_reason == "stop" and req.output_ids[-1] in smollm2.eos_token_ids
        jsonschema.validate(json.loads(tok.decode(req.output_ids)), schema)
        assert eng.num_free_blocks == eng.blocks.capacity
        outs.append(req.output_ids)
    assert outs[0] == outs[1]


def masked_reference(loaded, prompt: list[int], p: SamplingParams, seed: int) -> list[int]:
    """Token by token: a full forward, the grammar's mask (-inf elsewhere), the sampler's draw at
    that position; until EOS or max_tokens."""
    assert p.structured is not None
    m, out = tiny_compiler().matcher(p.structured), []
    mask = torch.zeros(1, mask_words(VOCAB), dtype=torch.int32)
    while len(out) < p.max_tokens and (not out or out[-1] != EOS_ID):
        m.fill_mask(mask, 0)
        logits = mask_logits(full_logits(loaded, prompt + out)[None], mask)
        st = SamplingTensors.from_params([p], [seed], "cpu")
        out.append(int(sample(logits, st, torch.tensor([len(prompt) + len(out)]))[0]))
        assert m.accept(out[-1])
    return out


@pytest.mark.parametrize("kind", ["regex", "choice"])
def test_seeded_sampling_at_k0_equals_the_masked_reference(tiny, kind):
    params = params_for(kind, temperature=0.9, seed=21, max_tokens=24)
    got = engine(tiny, 0).generate([PROMPT], params)[0].output_ids
    assert got == masked_reference(tiny, PROMPT, params, 21)


def test_sampled_mtp_keeps_the_masked_distribution(tiny):
    """k = 3 rejection sampling against masked targets: the choices' frequencies over 400 seeds
    against their exact probabilities (products of masked softmaxes), a chi-square test. tiny's
    random MTP head's drafts are nearly always rejected: this checks the residual draws."""
    options = ["ab", "ac", "bd", "bb"]
    spec = StructuredSpec.choice(options)
    exact = {}
    for o in options:
        prob, seen = 1.0, []
        for c in o.encode():
            allowed = sorted({x.encode()[len(seen)] for x in options if x.encode()[: len(seen)] == bytes(seen)})
            z = torch.softmax(full_logits(tiny, PROMPT + seen)[allowed], 0)
            prob *= float(z[allowed.index(c)])
            seen.append(c)
        exact[o] = prob
    n = 400
    eng = engine(tiny, 3, max_num_seqs=64)
    reqs = eng.generate([PROMPT] * n, [SamplingParams(max_tokens=4, temperature=1.0, seed=s, structured=spec)
                                       for s in range(n)])
    counts = Counter(text_of(r) for r in reqs)
    assert set(counts) <= set(options)
    chi2 = sum((counts[o] - n * exact[o]) ** 2 / (n * exact[o]) for o in options)
    assert chi2 < 16.3, (counts, exact)  # 3 degrees of freedom: p = 0.001
    assert eng.num_free_blocks == eng.blocks.capacity


def test_abort_mid_generation_frees_the_matcher_and_blocks(tiny):
    eng = engine(tiny, 3)
    rid = eng.add_request(PROMPT, params_for("json"))
    other = eng.add_request(PROMPT[:3], params_for("regex"))
    for _ in range(4):
        eng.step()
    eng.abort(rid)
    while eng.has_unfinished():
        eng.step()
    assert eng.requests[rid].finish_reason == "abort"
    check("regex", text_of(eng.requests[other]))
    assert not eng.batch.constrained and eng.num_free_blocks == eng.blocks.capacity
    state = eng.runner.state
    assert state.grammar_mask is not None and bool((state.grammar_mask == -1).all())  # every slot unmasked again


def test_in_halves_a_request_ended_at_the_read_frees_its_blocks_after_the_next_read(tiny, monkeypatch):
    """In halves the forward of step N + 1 is queued before step N is read, and it still writes
    the rows the host ends at that read: their blocks are refcounted until N + 1 is read."""
    from engine.runner.constrained import ConstrainedRows

    real, seen = ConstrainedRows.advance, {"n": 0}

    def advance(self, slot, tokens, drafts):  # the third read of the request's steps refuses its tokens
        seen["n"] += 1
        return seen["n"] < 3 and real(self, slot, tokens, drafts)

    monkeypatch.setattr(ConstrainedRows, "advance", advance)
    eng = engine(tiny, 2)
    rid = eng.add_request(PROMPT, SamplingParams(max_tokens=40, structured=SPECS["regex"]))
    eng.add_request(PROMPT[:4], SamplingParams(max_tokens=30, ignore_eos=True))
    blocks: list[int] = []
    while eng.requests[rid].finish_reason is None:
        blocks = list(eng.requests[rid].block_ids) or blocks
        eng.step()
    assert eng.requests[rid].finish_reason.startswith("error: ") and blocks
    assert all(eng.blocks.refcount(b) > 0 for b in blocks)  # the forward in flight may still write them
    eng.step()
    assert all(eng.blocks.refcount(b) == 0 for b in blocks)
    while eng.has_unfinished():
        eng.step()
    assert eng.num_free_blocks == eng.blocks.capacity


def test_a_structural_tag_call_is_exact_under_mtp_and_matches_its_schema(tiny):
    """A structural tag (tool calls, issue 53): a hermes-style call whose arguments follow SCHEMA.
    `at_least_one` makes the random model write it; k = 3 gives the k = 0 tokens."""
    begin = '<tool_call>\n{"name": "get", "arguments": '
    tag = {"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": ["<tool_call>"], "at_least_one": True, "stop_after_first": True,
        "tags": [{"type": "tag", "begin": begin, "content": {"type": "json_schema", "json_schema": SCHEMA},
                  "end": "}\n</tool_call>"}]}}
    params = SamplingParams(max_tokens=200, structured=StructuredSpec("structural_tag", json.dumps(tag)))
    want = engine(tiny, 0).generate([PROMPT], params)[0]
    text = text_of(want)
    assert text.startswith(begin) and text.endswith("}\n</tool_call>"), text
    jsonschema.validate(json.loads(text[len(begin):-len("}\n</tool_call>")], strict=False), SCHEMA)
    eng = engine(tiny, 3)
    assert eng.generate([PROMPT], params)[0].output_ids == want.output_ids
    assert eng.num_free_blocks == eng.blocks.capacity


@pytest.mark.parametrize(("k", "vocab"), [(0, 96), (1, 128)])
def test_masks_and_their_slots_staged_together_reach_their_state_rows(monkeypatch, k, vocab):
    """write_masks_no_sync stages a step's masks and then their slot ids in one host buffer (one
    copy on a GPU; consecutive slots need no ids): each constrained slot's state row gets its rows,
    every other row keeps all ones, whether the masks fill an odd number of words (the ids then
    start one word later) or not, and with the buffer reused by steps of other slots."""
    from engine.runner.batch_state import BatchState
    from engine.runner.constrained import ConstrainedRows

    # (0, 96): 3 words a row, one row a slot, so 1 and 3 slots' masks fill an odd number of words
    state = BatchState(capacity=6, k=k, max_blocks=4, vocab=vocab, device=torch.device("cpu"))
    runner = type("Runner", (), {"k": k, "grammar": None, "state": state})()
    rows = ConstrainedRows(runner)

    def fill(matchers, drafts, host):  # row j * (k + 1) + i: matcher j's slot, position i, in every word
        for j, slot in enumerate(matchers):
            for i in range(k + 1):
                host[j * (k + 1) + i] = 100 * slot + i

    monkeypatch.setattr(rows, "_fill_levels", fill)
    words = -(-vocab // 32)
    for constrained, launch in (([5], [2, 5, 0]), ([1, 4, 5], [4, 1, 3, 5]), ([2, 3, 4], [2, 3, 4, 5])):
        for s in set(rows.matchers) - set(constrained):
            rows.remove(s)  # its row allows everything again
        rows.matchers.update({s: s for s in constrained})  # the fill above reads a slot as its matcher
        rows.write_masks_no_sync(launch)
        for s in launch:
            want = 100 * s + torch.arange(k + 1).view(-1, 1) if s in constrained else torch.full((k + 1, 1), -1)
            assert torch.equal(state.grammar_mask[s], want.int().expand(k + 1, words)), s
