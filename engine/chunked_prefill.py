"""ChunkedPrefill: admitted requests' prompts, computed a token budget at a time, into the decode batch.

Receives requests that hold their slot and their whole KV room already (admission is the
caller's: LLMEngine admits from its waiting queue, the colocated node at `Submit`). Each `step`
computes at most `budget` prompt tokens (FIFO; a prompt longer than what is left of the budget
is cut into chunks that later steps continue) as one prefill launch, registers the computed full
blocks with the prefix cache, and hands on, for every prompt that completes, its first token (an
output delta, with logprobs when asked) and the request itself, inserted into the decode batch
with its MTP drafts. The caller runs one decode step after each prefill step, so a running
request waits at most one budget's worth of prefill between two of its steps.

Holds integers and lists; tensors stay in the runner. Never syncs except at the prefill read
point (the first tokens), as LLMEngine always did.
"""

from __future__ import annotations

from engine.decode_batch import DecodeBatch
from engine.fork import fork_no_sync
from engine.model_runner import ModelRunner, logprob_columns
from engine.prefill_step import PrefillChunk
from engine.prefix_cache import PrefixCache
from engine.prompt_logprobs import add_prompt_logprobs
from engine.request import Request, RequestOutput


class ChunkedPrefill:
    def __init__(self, runner: ModelRunner, prefix: PrefixCache, batch: DecodeBatch, budget: int) -> None:
        if budget <= 0:
            raise ValueError(f"the prefill token budget (max_num_batched_tokens) must be > 0, got {budget}")
        self.runner, self.prefix, self.batch, self.budget = runner, prefix, batch, budget
        self.requests: list[Request] = []  # admitted, prompt not fully computed; in arrival order

    @property
    def queued_tokens(self) -> int:
        """Prompt tokens still to compute."""
        return sum(len(r.prompt) - r.num_prefilled for r in self.requests)

    def add(self, req: Request) -> None:
        """A request holding its slot and blocks (`num_prefilled`: its cached prefix)."""
        self.requests.append(req)

    def drop(self, req: Request) -> None:
        """Forget a request (aborted); its blocks and slot are the caller's to free."""
        if req in self.requests:
            self.requests.remove(req)

    def schedule(self) -> tuple[list[PrefillChunk], list[Request]]:
        """This step's chunks: FIFO under the token budget."""
        budget, chunks, reqs = self.budget, [], []
        for req in self.requests:
            if budget <= 0:
                break
            end = min(len(req.prompt), req.num_prefilled + budget)
            chunks.append(PrefillChunk(req.prompt, req.num_prefilled, end, req.block_ids, req.params, req.seed))
            reqs.append(req)
            budget -= end - req.num_prefilled
        return chunks, reqs

    def step(self) -> list[RequestOutput]:
        """Compute this step's chunks (nothing when none is waiting); first tokens of completed prompts."""
        chunks, reqs = self.schedule()
        return self.run(chunks, reqs) if chunks else []

    def run(self, chunks: list[PrefillChunk], reqs: list[Request]) -> list[RequestOutput]:
        out = self.runner.prefill(chunks)
        for c, req in zip(chunks, reqs, strict=True):
            req.num_prefilled = c.end
            self.prefix.register(req.block_ids, req.block_hashes, c.end)
        add_prompt_logprobs(out, reqs)
        if not out.last_rows:
            return []
        firsts = out.first_token.tolist()  # the prefill read point (not in the decode loop)
        lp_nums = {i: chunks[r].logprobs or 0 for i, r in enumerate(out.last_rows) if chunks[r].logprobs is not None}
        lps = logprob_columns(out.logprobs, lp_nums, out.logprob_rows, 1) if out.logprobs else {}
        results = []
        for i, r in enumerate(out.last_rows):
            req = reqs[r]
            self.requests.remove(req)
            fork_no_sync(self.batch, req)  # n > 1: before the first token may end it
            results.append(self.batch.emit(req, [firsts[i]], lps.get(i)))
            results[-1].prompt_logprobs = req.prompt_logprobs
            if not req.finished:
                drafts = out.drafts[i] if out.drafts is not None else None
                probs = out.draft_probs[i] if out.draft_probs is not None else None
                self.batch.insert(req, out.first_token[i], drafts, probs)
        return results
