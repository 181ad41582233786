"""LLMEngine: the single-process engine (continuous batching, chunked prefill, MTP on/off).

Receives token-id prompts with SamplingParams; hands back per-step output deltas. Each `step`
runs one prefill batch (a token budget of prompt chunks, FIFO: engine/sched/chunked_prefill.py, which
the colocated node runs too) and one overlapped decode step:
the decode step N+1 is launched before step N's results are read. The scheduler part holds
integers and lists only; tensors live in the ModelRunner. The prefill and decode nodes reuse
the same pieces (`ModelRunner.prefill`, `insert_no_sync`, `launch_decode`/`collect`).

KV blocks are reserved for a request's whole life at admission (prompt + max_tokens + MTP
room; with `enable_prefix_caching` its longest cached prefix is shared and prefill starts after
it: engine/cache/prefix_cache.py; n > 1 choices share the prompt's blocks: engine/sched/fork.py), so a running request never needs preemption; blocks are freed only after the decode
step in flight has been collected, so no launched step can write into a reused block.

Structured output (`SamplingParams.structured`, issue 28): the runner's grammar compiler
(engine/grammar/compiler.py) checks a spec at `add_request`; prefill and decode mask the logits with it
(engine/runner/constrained.py).
"""

from __future__ import annotations

import itertools
import logging
import random
import time
from collections import deque
from dataclasses import dataclass

import torch

from engine.cache.kv_cache import BlockManager, KVCache
from engine.cache.prefix_cache import PrefixCache
from engine.grammar.compiler import GrammarCompiler
from engine.grammar.structured import NEEDS_EOS
from engine.model.attention import get_backend
from engine.model.llama import fuse_projections
from engine.model.loader import LoadedModel
from engine.request import PrefillChunk, Request, RequestOutput
from engine.runner.cuda_graphs import bucket_sizes, decode_widths
from engine.runner.model_runner import MAX_GRAPH_ROWS, MAX_GRAPH_TOKENS, ModelRunner, kv_room_needed
from engine.runner.prefill_graphs import MIN_TOKENS, pow2_buckets
from engine.runner.shapes import ShapeLog
from engine.sampling.sampling_params import SamplingParams
from engine.sched.chunked_prefill import ChunkedPrefill
from engine.sched.decode_batch import DecodeBatch
from engine.sched.fork import allocate_children, group_fits, make_children, shared_blocks
from engine.spec_decode.draft_vocab import DraftVocab, read_ranking
from engine.tp.tensor_parallel import (
    TPCausalLM,
    TPGroup,
    apply_tensor_parallel,
    full_config,
    max_kv_heads,
)

log = logging.getLogger(__name__)

K_POLICIES = ("fixed", "adaptive")
AUTO_DRAFT_VOCAB = 32768  # the default draft vocabulary of a model with a ranking (`auto_draft_vocab`)


@dataclass(frozen=True)
class EngineConfig:
    num_speculative_tokens: int = 0
    # MTP drafts score the N most frequent tokens (FR-Spec); 0 or >= V: all; None: `auto_draft_vocab`
    draft_vocab_size: int | None = None
    # "fixed": every decode step verifies k drafts; "adaptive": k or 0 per step, from measured
    # acceptance and step costs (engine/spec_decode/adaptive_k.py)
    spec_k_policy: str = "fixed"
    block_size: int = 16
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None  # default: min(model's max positions, 4096)
    kv_cache_bytes: int = 512 << 20
    num_blocks: int | None = None  # overrides kv_cache_bytes
    device: str = "cpu"
    attention_backend: str = "auto"  # auto: Triton kernels on CUDA, the torch reference elsewhere
    enforce_eager: bool = False  # no CUDA graphs (as vLLM's --enforce-eager)
    deterministic: bool = False  # batch-invariant kernels: a greedy answer is the same in any batch
    block_shuffle_seed: int | None = None  # scatter block ids (tests)
    seed: int = 0  # draws per-request seeds when a request gives none
    enable_prefix_caching: bool = False  # reuse computed KV blocks of earlier prompts (as vLLM's flag)
    warmup: bool = False  # nodes: capture the graphs requests meet first before serving, the rest when idle (engine/runner/warmup.py)

    def __post_init__(self) -> None:
        if self.num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens (k) must be >= 0, got {self.num_speculative_tokens}")
        if self.spec_k_policy not in K_POLICIES:
            raise ValueError(f"spec_k_policy must be one of {K_POLICIES}, got {self.spec_k_policy!r}")
        if self.draft_vocab_size is not None and self.draft_vocab_size < 0:
            raise ValueError(f"draft_vocab_size must be >= 0 (0: the full vocabulary), got {self.draft_vocab_size}")
        if self.block_size <= 0 or self.max_num_seqs <= 0 or self.max_num_batched_tokens <= 0:
            raise ValueError("block_size, max_num_seqs and max_num_batched_tokens must be > 0")


def build_runner(loaded: LoadedModel, config: EngineConfig, decodes: bool = True,
                 tp: TPGroup | None = None) -> tuple[ModelRunner, BlockManager, int]:
    """The runner, its block manager and the context length, sized from `config`.

    With `tp` (a group of size > 1) the model is sharded for this rank first (in place:
    engine/tp/tensor_parallel.py); every rank gets the same number of KV blocks. On CUDA the
    model's projections are fused and, unless `enforce_eager` or the runner never `decodes`
    (a prefill node), the decode step's CUDA graphs are captured here; prefill steps get CUDA
    graphs too (captured on first use), unless `enforce_eager`. With adaptive k (one process, CUDA
    graphs) the greedy steps at k and at 0 are timed per bucket here (engine/spec_decode/adaptive_k.py);
    elsewhere nothing is timed and every step runs at k."""
    k = config.num_speculative_tokens
    if k and loaded.model.mtp is None:
        raise ValueError("this model has no MTP module; use num_speculative_tokens=0")
    arch = loaded.model.config
    max_model_len = config.max_model_len or min(arch.max_position_embeddings, 4096)
    if max_model_len > arch.max_position_embeddings:  # rotary tables end there: a longer request would fail mid-prefill
        raise ValueError(f"max_model_len {max_model_len} is longer than the model's {arch.max_position_embeddings} "
                         "positions")
    num_blocks = _num_blocks(loaded, config, max_model_len, tp.size if tp is not None else 1)
    blocks = BlockManager(num_blocks, config.block_size, config.block_shuffle_seed)
    draft_vocab = draft_vocab_for(loaded, config)  # from the whole LM head: replicated under TP
    if tp is not None and tp.size > 1:
        apply_tensor_parallel(loaded.model, tp)
    device = torch.device(config.device)
    if device.type == "cuda":
        fuse_projections(loaded.model)
    graphs = device.type == "cuda" and not config.enforce_eager
    single = tp is None or tp.size == 1  # prefill graphs are not tried under TP yet
    runner = ModelRunner(
        loaded.model, get_backend(config.attention_backend, config.device), k, num_blocks,
        config.block_size, config.max_num_seqs, max_model_len, device, next(loaded.model.parameters()).dtype,
        cuda_graphs=graphs and decodes, deterministic=config.deterministic, draft_vocab=draft_vocab,
        prefill_graph_tokens=min(config.max_num_batched_tokens, MAX_GRAPH_TOKENS) if graphs and single else 0,
        adaptive_k=config.spec_k_policy == "adaptive",
    )
    runner.grammar = GrammarCompiler(loaded.tokenizer, runner.state.vocab, loaded.eos_token_ids)  # compiles on first use
    runner.shapes = shape_log(runner, config, max_model_len)
    if runner.graphs is not None:
        start = time.perf_counter()
        runner.graphs.capture_greedy()
        if len(runner.step_ks) > 1 and single:  # TP ranks would time differently, then choose differently: K
            runner.step_costs = runner.graphs.step_costs()
        log.info("greedy decode graphs: %d in %.1f s", len(runner.graphs.graphs), time.perf_counter() - start)
    return runner, blocks, max_model_len


def shape_log(runner: ModelRunner, config: EngineConfig, max_model_len: int) -> ShapeLog:
    """The runner's step shapes under `config`'s limits (engine/runner/shapes.py): its graphs' buckets
    (those it would have on a GPU when it has none). A prompt resumes after a prefix when it can be
    longer than a step's token budget, or when a prefix cache is on."""
    graphs = runner.prefill_graphs
    tokens = graphs.token_buckets if graphs is not None else pow2_buckets(
        MIN_TOKENS, max(MIN_TOKENS, min(config.max_num_batched_tokens, MAX_GRAPH_TOKENS)))
    rows = graphs.row_buckets if graphs is not None else pow2_buckets(1, min(config.max_num_seqs, MAX_GRAPH_ROWS))
    widths = runner.graphs.widths if runner.graphs is not None else {
        b: decode_widths(runner, b) for b in bucket_sizes(config.max_num_seqs)}
    resumes = max_model_len - 1 > config.max_num_batched_tokens or config.enable_prefix_caching
    return ShapeLog(tokens, rows, widths, max_model_len, resumes)


def _num_blocks(loaded: LoadedModel, config: EngineConfig, max_model_len: int, tp_size: int) -> int:
    """KV blocks: room for `max_num_seqs` whole contexts, capped by `kv_cache_bytes` of this
    rank's cache (sized for the most KV heads a rank of the TP group holds, from the whole
    model's config: the same count when an engine gets a model sharded already)."""
    arch, k = full_config(loaded.model), config.num_speculative_tokens
    if config.num_blocks:
        return config.num_blocks
    dtype = next(loaded.model.parameters()).dtype
    layers = arch.num_hidden_layers + (1 if k else 0)
    per_seq = -(-kv_room_needed(max_model_len, k) // config.block_size)
    heads = max_kv_heads(arch, tp_size)
    per_block = KVCache.bytes_per_block(layers, config.block_size, heads, arch.head_dim, dtype)
    return min(1 + config.max_num_seqs * per_seq, config.kv_cache_bytes // per_block)


def prefix_cache_for(loaded: LoadedModel, config: EngineConfig, blocks: BlockManager) -> PrefixCache:
    """The scheduler's prefix cache (off unless `enable_prefix_caching`); keys carry the model's
    identity, and with MTP (k > 0) the token after each block (engine/cache/prefix_cache.py)."""
    dtype = next(loaded.model.parameters()).dtype
    k = config.num_speculative_tokens
    return PrefixCache(blocks, f"{loaded.name}|{dtype}|mtp={k > 0}", 1 if k else 0, config.enable_prefix_caching)


def auto_draft_vocab(vocab: int, ranked: bool) -> int:
    """The default draft vocabulary: FR-Spec's AUTO_DRAFT_VOCAB most frequent tokens where the
    vocabulary is larger and the model has a ranking beside its MTP head, else all of it (0).
    Verification always scores the full vocabulary, so this moves acceptance, never the output;
    a large vocabulary's draft heads cost a share of the k > 0 step that grows with V (Llama-3's
    128k), and the tokens past the top 32k are rarely drafted right."""
    return AUTO_DRAFT_VOCAB if ranked and vocab > AUTO_DRAFT_VOCAB else 0


def draft_vocab_for(loaded: LoadedModel, config: EngineConfig) -> DraftVocab | None:
    """The draft vocabulary `config` asks for (by default `auto_draft_vocab`'s); None when drafts
    score the full vocabulary (size 0 or >= V, or no MTP: k = 0)."""
    vocab = loaded.model.config.vocab_size
    n = config.draft_vocab_size
    if n is None:  # the default; a model already sharded for TP (a second engine over it) keeps all tokens
        sharded = isinstance(loaded.model, TPCausalLM)
        n = 0 if sharded else auto_draft_vocab(vocab, loaded.vocab_rank_path is not None)
    if config.num_speculative_tokens == 0 or n == 0 or n >= vocab:
        return None
    if loaded.vocab_rank_path is None:
        raise ValueError(
            f"a draft vocabulary of {n} tokens needs a vocabulary ranking, and model {loaded.name!r} has none "
            "beside its MTP head (make one with `pdserve draft-vocab`); 0 drafts over the full vocabulary"
        )
    if isinstance(loaded.model, TPCausalLM):
        raise ValueError("a draft vocabulary is gathered from the whole LM head: load the model again "
                         "(this one is already sharded for tensor parallelism)")
    ranking = read_ranking(loaded.vocab_rank_path, vocab)
    return DraftVocab.build(loaded.model.lm_head.weight, ranking, n)


def resolve_request(
    request_id: str, prompt: list[int], params: SamplingParams, eos_ids: tuple[int, ...],
    max_model_len: int, rng: random.Random, vocab: int,
) -> Request:
    """Validate a prompt against the model and make its Request (seed, stop ids, max tokens)."""
    if not prompt:
        raise ValueError("prompt is empty")
    if any(not 0 <= t < vocab for t in prompt):
        raise ValueError(f"prompt has token ids outside the vocabulary (0..{vocab - 1})")
    if len(prompt) >= max_model_len:
        raise ValueError(
            f"prompt is {len(prompt)} tokens; the context is {max_model_len} (room for >= 1 output token needed)"
        )
    stop = tuple(params.stop_token_ids) + (() if params.ignore_eos else eos_ids)
    if params.structured is not None and eos_ids and not set(eos_ids) & set(stop):
        raise ValueError(NEEDS_EOS)
    seed = params.seed if params.seed is not None else rng.getrandbits(62)
    max_tokens = min(params.max_tokens, max_model_len - len(prompt))
    return Request(request_id, list(prompt), params, seed, tuple(dict.fromkeys(stop)), max_tokens)


class LLMEngine:
    """With `tp`, this process is one rank of a TP group: every rank runs the same engine on the
    same requests (the same scheduling, the same sampled tokens); rank 0 reports them."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig, tp: TPGroup | None = None) -> None:
        self.loaded, self.config = loaded, config
        self.tokenizer = loaded.tokenizer
        self.k = config.num_speculative_tokens
        self.runner, self.blocks, self.max_model_len = build_runner(loaded, config, tp=tp)
        self.prefix = prefix_cache_for(loaded, config, self.blocks)
        self.waiting: deque[Request] = deque()  # in arrival order; blocks taken at prefill start
        self.batch = DecodeBatch(self.runner, self.blocks, config.max_num_seqs)
        self.prefill = ChunkedPrefill(self.runner, self.prefix, self.batch, config.max_num_batched_tokens)
        self.requests: dict[str, Request] = {}
        self._rng = random.Random(config.seed)
        self._ids = itertools.count()

    # ---- requests -------------------------------------------------------------------
    def add_request(self, prompt: list[int], params: SamplingParams, request_id: str | None = None) -> str:
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self.requests:
            raise ValueError(f"duplicate request id {rid!r}")
        vocab = self.loaded.model.config.vocab_size
        req = resolve_request(rid, prompt, params, self.loaded.eos_token_ids, self.max_model_len, self._rng, vocab)
        if params.structured is not None and self.runner.grammar is not None:
            self.runner.grammar.compile(params.structured)  # a spec that does not compile: ValueError now
        self.requests[rid] = req
        self.waiting.append(req)
        return rid

    def abort(self, request_id: str) -> None:
        req = self.requests.get(request_id)
        if req is None or req.finished:
            return
        if req in self.waiting:
            self.waiting.remove(req)
        self.prefill.drop(req)
        for r in (req, *req.children):
            if not r.finished:
                self.batch.finish(r, "abort")

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.prefill.requests or self.batch.busy)

    @property
    def num_free_blocks(self) -> int:
        return self.blocks.num_free

    # ---- the step -------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        chunks, reqs = self._schedule_prefill()
        if chunks:
            outputs += self._run_prefill(chunks, reqs)
        return outputs + self.batch.step()

    def _schedule_prefill(self) -> tuple[list[PrefillChunk], list[Request]]:
        while self.waiting and self._admit(self.waiting[0]):
            self.prefill.add(self.waiting.popleft())
        return self.prefill.schedule()

    def _admit(self, req: Request) -> bool:
        """Reserve a slot and the request's whole KV room (its cached prefix shared), or leave it waiting."""
        need = self.blocks.blocks_for(kv_room_needed(len(req.prompt) + req.max_tokens, self.k))
        n, bs = req.params.n, self.blocks.block_size
        shared = shared_blocks(len(req.prompt), bs)
        if need + (n - 1) * (need - shared) > self.blocks.capacity or n > self.config.max_num_seqs:
            self.waiting.popleft()
            self.batch.finish(req, "error: request needs more KV blocks or slots than the engine has")
            return bool(self.waiting) and self._admit(self.waiting[0])
        if len(self.batch.free_slots) < n:
            return False
        if not req.block_hashes:
            req.block_hashes = self.prefix.hashes(req.prompt, req.params.prompt_logprobs is not None)
        if not group_fits(self.blocks, self.blocks.match(req.block_hashes), need, n, shared):
            return False
        got = self.prefix.allocate(req.prompt, req.block_hashes, need)
        assert got is not None  # checked above, for every choice
        req.block_ids, req.num_prefilled = got  # prefill starts after the cached prefix
        req.children = make_children(req)
        allocate_children(self.blocks, req, need, bs)
        for r in (req, *req.children):
            r.slot = self.batch.take_slot()
        return True

    def _run_prefill(self, chunks: list[PrefillChunk], reqs: list[Request]) -> list[RequestOutput]:
        return self.prefill.run(chunks, reqs)

    # ---- convenience ----------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[Request]:
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, plist, strict=True)]
        while self.has_unfinished():
            self.step()
        return [self.requests.pop(i) for i in ids]
