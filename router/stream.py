"""Stream: a placed request's tokens, from its nodes to its client's messages.

Receives P's first token (PD) and the decode node's output items (holds.py routes them to the
request's `events`), and turns them into client messages through RequestState (detokenizing,
stop strings, logprobs: router/request.py) until every choice has ended. A choice the router
ends while the node still runs it (a stop string in an n > 1 request) is aborted alone on the
node. Raises AttemptLost when the decode node is lost or gave up the attempt (every item it sent
before is read first: those tokens count and are not computed again). Never places anything.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

from protos.messages import FirstToken, OutputItem, TokenLogprobs
from router.holds import Holds
from router.metrics import RouterMetrics
from router.migration import AttemptLost
from router.request import RequestError, RequestState, Wake


class Stream:
    def __init__(self, metrics: RouterMetrics, holds: Holds) -> None:
        self.metrics, self.holds = metrics, holds

    async def run(self, st: RequestState, first: FirstToken | None,
                  confirm: Callable[[], Awaitable[None]] | None = None) -> None:
        """Stream the first token (from P; None on a colocated node, where it is an output item
        too), then the node's output items until every choice has ended (router/request.py).
        `confirm` (placement.py's `Prefilled.confirm`) runs once the first token is out: the decode
        node sends nothing before it holds the KV, so no later token waits for it."""
        if first is not None:
            ch = st.choices[0]
            ch.node_done = first.finished is not None  # D sends no terminal for it
            st.decode_live = _node_runs_any(st)
            st.set_prompt_logprobs(first.prompt_logprobs)
            st.cached_tokens = first.cached_tokens
            complete = self._add_tokens(st, [first.token], first.logprobs)
            if first.finished or complete:
                st.finish_choice(0, "stop" if ch.text.stopped else first.finished or ch.stop_reason)
                self._stop_choice(st, 0)
        if confirm is not None:
            try:
                await confirm()
            except AttemptLost:
                if not st.done:  # a request that ended with its first token needs nothing more of P
                    raise
        sink = partial(self._take, st, asyncio.current_task())
        while not st.done:
            item = await self._next_item(st, sink)
            if item is not None:
                self._on_item(st, item)

    def _on_item(self, st: RequestState, item: OutputItem) -> None:
        """One output item of choice `item.index`; AttemptLost when the node gave up the attempt."""
        if item.index >= len(st.choices):
            raise RequestError("INTERNAL", f"{st.decode.kind if st.decode else 'a'} node sent choice "
                                           f"{item.index} of a request of {len(st.choices)}")
        ch = st.choices[item.index]
        st.steps, st.accepted = st.steps + item.steps, st.accepted + item.accepted
        st.cached_tokens = item.cached_tokens or st.cached_tokens
        if item.error is not None and not item.malformed:  # the node ended every choice of this attempt
            for c in st.choices:  # (an item refused here: the node may still hold it, Abort goes)
                c.node_done = True
        ch.node_done = ch.node_done or item.finish_reason is not None
        st.decode_live = _node_runs_any(st)
        if ch.finish_reason is not None and item.error is None:
            return  # the router ended this choice already: late tokens
        if item.prompt_logprobs is not None:  # a colocated node's first item
            st.set_prompt_logprobs(item.prompt_logprobs)
        if item.tokens and not st.num_tokens:  # since its Submit: the node's queue and compute, then the way back
            st.timeline.prefill_window(item.queue_s, item.compute_s)
        complete = self._add_tokens(st, item.tokens, item.logprobs, item.index)
        if ch.text.stopped and ch.finish_reason is None:
            st.finish_choice(ch.index, "stop")
        if item.error is not None and not st.done:  # D gave up on this attempt (its KV never came, ...)
            assert st.decode is not None  # or sent an item refused here: move it
            raise AttemptLost(f"{st.decode.kind} node {st.decode.address}: {item.error}")
        if ch.finish_reason is not None:
            pass  # ended here already (a stop string, or earlier)
        elif item.finish_reason is not None:
            st.finish_choice(ch.index, item.finish_reason)
        elif complete:
            st.finish_choice(ch.index, ch.stop_reason)
        self._stop_choice(st, ch.index)

    def _stop_choice(self, st: RequestState, index: int) -> None:
        """A choice of an n > 1 request the router ended while the node still runs it: abort that
        choice alone (`{node id}#{index}`), so its siblings go on. With n = 1 the request's own end
        does it (`Holds.release`)."""
        ch = st.choices[index]
        if len(st.choices) == 1 or ch.finish_reason is None or ch.node_done or st.done or st.decode is None:
            return
        ch.node_done = True
        st.decode_live = _node_runs_any(st)
        self.holds.spawn_abort(st.decode, f"{st.node_rid}#{index}", "the choice ended at the router")

    async def _next_item(self, st: RequestState, sink: Callable[[OutputItem], None]) -> OutputItem | None:
        """The next output item from the decode node, or None once `sink` ended the request;
        AttemptLost once the node failed and every item it sent before is read (those tokens count:
        they are not computed again). The loss comes as the placement's `lost` future in the same
        queue (`RequestState.lose`), so a wait is one queue get, not a task raced against the loss;
        an older placement's is passed over. While the queue is empty, `sink` takes the items."""
        while True:
            if st.events.empty():
                st.sink = sink
                try:
                    item = await st.events.get()
                finally:
                    st.sink = None
            else:
                item = st.events.get_nowait()
            if isinstance(item, Wake):
                if item.error is not None:
                    raise item.error
                return None
            if not isinstance(item, asyncio.Future):
                return item
            if item is st.lost:
                raise AttemptLost(item.result())

    def _take(self, st: RequestState, driver: asyncio.Task[Any] | None, item: OutputItem) -> None:
        """`st`'s sink: `item` handled at once in the output reader's task, as the driver would have
        after a wake-up (that wake-up per item was most of the router's per-token cost). The driver
        is woken only when the request ended or the item raised (it raises it). A driver already
        cancelled (an interrupt, its deadline) never reads the item: it is queued, as before."""
        if not st.events.empty() or driver is None or driver.cancelling():
            st.events.put_nowait(item)
            return
        try:
            self._on_item(st, item)
        except Exception as e:  # noqa: BLE001 - raised in the driver, which handles it
            st.sink = None
            st.events.put_nowait(Wake(e))
            return
        if st.done:
            st.sink = None
            st.events.put_nowait(Wake())

    def _add_tokens(self, st: RequestState, tokens: list[int], logprobs: TokenLogprobs | None,
                    index: int = 0) -> bool:
        sent = st.choices[index].tokens
        before = len(sent)
        complete = st.add_tokens(tokens, logprobs, index)
        self.metrics.tokens(st, len(sent) - before)
        return complete


def _node_runs_any(st: RequestState) -> bool:
    """Whether the node may still run some choice of `st` (it has not ended them all)."""
    choices = st.choices
    return not choices[0].node_done if len(choices) == 1 else not all(c.node_done for c in choices)
