"""Step stamps: the GPU's own clock at the start and the end of every decode step (`settings.STEP_STAMPS`).

What it measures. Each decode graph (engine/runner/cuda_graphs.py) opens with one launch of
`_stamp_kernel` and closes with another. Each reads the GPU's `%globaltimer` (nanoseconds,
the same clock on every SM) and stores it into a ring of N steps on the device:

    start stamp:  buf[2 * (c % N)]     = globaltimer                  c = count[0]
    end stamp:    buf[2 * (c % N) + 1] = globaltimer;  count[0] = c + 1

One program, launched in stream order, so a plain load and store of the counter is enough; the
slot advances on the device, so every replay of the same graph writes the next one. Both kernels
wait for the kernel before them (kernels/pdl.py) before they read the clock, so a step's span runs
from when its first kernel (the start stamp) runs to when its last kernel has finished. How often
`%globaltimer` ticks is the GPU's choice (PTX leaves its update rate to the implementation; not
yet checked on an H100): a single span is only as fine as that, the means over many steps finer.

`stamped_busy` turns the spans into `gpu_busy_stamped`: the sum of the steps' spans over the time
from the first step's start to the last one's end. Idle time inside a step (launch latency between
its kernels, a kernel waiting under PDL) counts as busy; idle between two steps (the host late
with the next replay: host starvation) does not. The work queued between the graphs (the rows'
copy before a replay, the outputs' copy to the host after it, a prefill step, an eager decode
step) falls in the gaps between steps too, and a constrained step's two graphs (`halves`) stamp
as one step, the host's mask writes between them inside it. The two stamp launches' own time (not
yet measured) is inside the span.

How it differs from `gpu_busy` (`bench engine --profile`, the torch profiler): that figure is the
union of the kernels' own spans, so it counts the gaps between kernels inside a step as idle, and
the profiler's host overhead (its callbacks at every launch) slows the host and widens the gaps
between steps. The stamps add two tiny kernels and nothing on the host, so `1 - gpu_busy_stamped`
is the share of the loop the GPU waited for the host, as the loop runs unprofiled. Under the
profiler too (`--profile` with the stamps on), the two stamp kernels count among a step's kernels,
and `layer_increments` (bench/step_trace.py) files the start stamp under the step before.

`%globaltimer` is read through inline PTX, which Triton's interpreter cannot run: the feature is
off on the CPU (and without CUDA), and with it off nothing is launched and the graphs are unchanged.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

import settings
from kernels.pdl import pdl_args, wait_for_previous

STEPS = 8192  # the ring's length in steps; `read` returns at most the last STEPS


@triton.jit
def _stamp_kernel(buf_ptr, count_ptr, N: tl.constexpr, END: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)  # the kernel before has finished: an end stamp reads the clock after the step
    c = tl.load(count_ptr)
    now = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)
    tl.store(buf_ptr + 2 * (c % N) + END, now)
    if END:
        tl.store(count_ptr, c + 1)


def stamps_on(device: torch.device) -> bool:
    """`settings.STEP_STAMPS` on a CUDA device, outside Triton's interpreter."""
    return (settings.STEP_STAMPS and device.type == "cuda"
            and os.environ.get("TRITON_INTERPRET") != "1")


class StepStamps:
    """The ring of (start, end) stamps of one device's decode steps, and its step counter."""

    def __init__(self, device: torch.device, steps: int = STEPS) -> None:
        self.steps = steps
        self.buf = torch.zeros(2 * steps, dtype=torch.int64, device=device)
        self.count = torch.zeros(1, dtype=torch.int64, device=device)

    def stamp_start(self) -> None:
        """Queue the start stamp of the next step (never syncs; may be captured in a graph)."""
        self._launch(end=False)

    def stamp_end(self) -> None:
        """Queue the end stamp of the step `stamp_start` began, and advance the counter."""
        self._launch(end=True)

    def _launch(self, end: bool) -> None:
        _stamp_kernel[(1,)](self.buf, self.count, N=self.steps, END=end, num_warps=1, **pdl_args(self.buf))

    def reset(self) -> None:
        """Forget the steps stamped so far (queued in stream order; never syncs)."""
        self.count.zero_()

    def read(self) -> list[tuple[int, int]]:
        """(start, end) in ns of the steps stamped since `reset`, oldest first: the last `steps`
        of them once the ring has wrapped. Synchronizes the device."""
        count, buf = int(self.count.item()), self.buf.tolist()  # each waits for the stream's stamps
        first = max(0, count - self.steps)
        return [(buf[2 * (i % self.steps)], buf[2 * (i % self.steps) + 1]) for i in range(first, count)]


def stamped_busy(spans: list[tuple[int, int]]) -> dict[str, float | None]:
    """`gpu_busy_stamped` (the spans' sum over first start to last end), `stamped_step_us` (mean
    span) and `stamped_gap_us` (mean idle from a step's end to the next one's start) of (start,
    end) stamps in ns, in step order; None where there are too few steps."""
    if not spans:
        return {"gpu_busy_stamped": None, "stamped_step_us": None, "stamped_gap_us": None}
    busy = sum(end - start for start, end in spans)
    gaps = [nxt[0] - cur[1] for cur, nxt in zip(spans, spans[1:], strict=False)]
    whole = spans[-1][1] - spans[0][0]
    return {"gpu_busy_stamped": round(busy / whole, 4) if whole > 0 else None,
            "stamped_step_us": round(busy / len(spans) / 1e3, 2),
            "stamped_gap_us": round(sum(gaps) / len(gaps) / 1e3, 2) if gaps else None}
