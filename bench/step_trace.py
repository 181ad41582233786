"""What each kernel adds to a decode step under PDL, from the profiler's kernel spans (`bench engine --profile`).

Under programmatic dependent launch a kernel starts before the one ahead of it ends and waits there,
so its span (and `top_kernels`' sums) counts time it only waited. What a kernel adds to the step is
how much later the step's work ends with it: its end minus the latest end of the kernels before it
(its `increment`, never below 0). Its `lead` is how long before that latest end it started (the part
of its span that overlapped the kernels before it). A step's increments add up to its span from its
first kernel's start to its last kernel's end; the GPU's idle time between steps is counted apart
(`boundary_idle_us`).

Kernels are grouped by their place in a layer: their offset from the last attention kernel before
them in the step (0: that attention kernel; before the step's first attention kernel, negative
offsets count back from it), and their name. With the decode step's launch order (q/k/v, attention,
o, its split-K sum, gate/up, down, its sum) offset 1 is every layer's o projection, and so on.
"""

from __future__ import annotations

from typing import Any

STEP_MARKER = "_step_inputs_kernel"  # a decode step's first kernel (kernels/step_meta.py)
ATTENTION = "attention"  # in the name of the decode attention kernel


def layer_increments(spans: list[tuple[float, float, str]], marker: str = STEP_MARKER) -> dict[str, Any]:
    """`spans`: (start, end, name) of every kernel over several steps, in microseconds. Returns the
    per-step figures over the complete steps (all but the first and last, when there are more than
    two): `steps`, `step_us` (mean span), `boundary_idle_us` (mean idle before a step's first kernel),
    and `groups`: [offset, name, launches a step, increment us a step, lead us a launch]."""
    steps = _split_steps(sorted(spans), marker)
    if len(steps) > 2:
        idle = [max(0.0, cur[0][0] - max(e for _, e, _ in prev)) for prev, cur in zip(steps[1:-2], steps[2:-1], strict=True)]
        steps = steps[1:-1]
    else:
        idle = []
    groups: dict[tuple[int, str], list[float]] = {}
    spans_us = []
    for step in steps:
        spans_us.append(max(e for _, e, _ in step) - step[0][0])
        for key, inc, lead in _increments(step):
            g = groups.setdefault(key, [0.0, 0.0, 0.0])
            g[0] += 1
            g[1] += inc
            g[2] += lead
    n = max(len(steps), 1)
    rows = [[off, name, round(c / n, 1), round(inc / n, 2), round(lead / c, 2)]
            for (off, name), (c, inc, lead) in sorted(groups.items())]
    return {"steps": len(steps), "step_us": round(sum(spans_us) / n, 1),
            "boundary_idle_us": round(sum(idle) / len(idle), 2) if idle else None, "groups": rows}


def _split_steps(spans: list[tuple[float, float, str]], marker: str) -> list[list[tuple[float, float, str]]]:
    """The spans cut into steps at each start of the marker kernel (spans before the first marker
    form a step of their own)."""
    steps: list[list[tuple[float, float, str]]] = []
    for span in spans:
        if not steps or marker in span[2]:
            steps.append([])
        steps[-1].append(span)
    return steps


def _increments(step: list[tuple[float, float, str]]) -> list[tuple[tuple[int, str], float, float]]:
    """((offset, name), increment, lead) of each kernel of one step, in launch (start) order."""
    last = next((i for i, (_, _, name) in enumerate(step) if ATTENTION in name), 0)  # the first, before any
    out = []
    latest = step[0][0]
    for i, (start, end, name) in enumerate(step):
        if ATTENTION in name:
            last = i
        out.append(((i - last, name[:40]), max(0.0, end - latest), max(0.0, latest - start)))
        latest = max(latest, end)
    return out
