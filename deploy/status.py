"""`pdserve status`: what a running service looks like, for operators.

Joins the Ray cluster as a short-lived driver (`--address auto`: the cluster this machine is
part of), finds the service's named actors (`pdserve-router`, `pdserve-prefill-0`, ...) in
its namespace and asks each for its state, with a deadline: a node that does not answer is
listed as down, never waited on. Reads Ray's node table for where each actor runs. Changes
nothing in the service.
"""

from __future__ import annotations

import json
import time
from typing import Any

from deploy.service import ACTOR_PREFIX, ROLES

RECENT_SHOWN = 8  # node failures listed under the table


def collect(timeout_s: float = 5.0) -> dict[str, Any]:
    """The service's state from an already connected Ray driver."""
    import ray

    names = sorted(str(n) for n in ray.util.list_named_actors() if str(n).startswith(ACTOR_PREFIX))
    if not names:
        ns = ray.get_runtime_context().namespace
        raise ValueError(f"no pdserve service in Ray namespace {ns!r} (is `pdserve up` running there?)")
    hosts = {n["NodeID"]: n for n in ray.nodes()}
    actors = {name: ray.get_actor(name) for name in names}
    refs: dict[str, Any] = {name: (h.status.remote() if name == f"{ACTOR_PREFIX}router" else h.info.remote())
            for name, h in actors.items()}
    ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
    out: dict[str, Any] = {"router": None, "nodes": []}
    for name, ref in refs.items():
        entry = _answer(ref, ready)
        entry["name"] = name
        entry.setdefault("role", name[len(ACTOR_PREFIX):].split("-", 1)[0])  # prefill-0, prefill-0-rank1
        entry.update(_placement(hosts.get(entry.get("ray_node_id", ""))))
        if name == f"{ACTOR_PREFIX}router":
            out["router"] = entry
        else:
            out["nodes"].append(entry)
    return out


def _answer(ref: Any, ready: list[Any]) -> dict[str, Any]:
    import ray

    if ref not in ready:
        return {"state": "down", "error": "no answer in time"}
    try:
        return {"state": "up", **ray.get(ref)}
    except Exception as e:  # the actor is dead or restarting
        return {"state": "down", "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}


def _placement(node: dict[str, Any] | None) -> dict[str, Any]:
    if node is None:
        return {}
    custom = {k: v for k, v in node.get("Resources", {}).items()
              if not k.startswith("node:") and k not in ("CPU", "GPU", "memory", "object_store_memory")}
    return {"ray_node_ip": node.get("NodeManagerAddress", ""), "ray_node_alive": node.get("Alive", False),
            "ray_node_resources": custom}


def render(state: dict[str, Any]) -> str:
    """A table an operator reads at a glance."""
    r = state["router"] or {"state": "missing"}
    lines = [f"router  {r.get('state')}  serving={r.get('serving')}  prefill={r.get('prefill_nodes', '-')} "
             f"decode={r.get('decode_nodes', '-')}  colocated={r.get('colocated_nodes', '-')}  "
             f"running={r.get('running_requests', '-')} "
             f"queued={r.get('queued_requests', '-')}  on {r.get('ray_node_ip', '?')}",
             f"{'NODE':<20}{'ROLE':<10}{'STATE':<7}{'ADDRESS':<22}{'RAY NODE':<17}{'RUN':>5}{'QUEUED':>8}"
             f"{'FREE KV':>9}{'TOTAL':>7}{'HIT TOK':>9}{'HIT REQ':>9}  RESOURCES"]
    for n in sorted(state["nodes"], key=lambda n: (ROLES.index(n.get("role", "prefill")), n["name"])):
        tok, req = hit_rates(n)
        lines.append(f"{n['name']:<20}{n.get('role', '?'):<10}{n['state']:<7}{n.get('address', '-'):<22}"
                     f"{n.get('ray_node_ip', '?'):<17}{n.get('running', '-'):>5}{n.get('queued_tokens', '-'):>8}"
                     f"{n.get('free_blocks', '-'):>9}{n.get('total_blocks', '-'):>7}{tok:>9}{req:>9}  "
                     f"{json.dumps(n.get('ray_node_resources', {}))}"
                     + ("  (restarted)" if n.get("restarted") else "")
                     + (f"  ({n['error']})" if n.get("error") else ""))
    downs = r.get("node_failures") or []
    if downs:
        lines.append(f"recent node failures (the router's view, newest last; {len(downs)}):")
        lines += [f"  {time.strftime('%H:%M:%S', time.localtime(d['at']))}  {d['kind']:<10}{d['address']:<22}"
                  f"{d['reason']}" for d in downs[-RECENT_SHOWN:]]
    return "\n".join(lines)


def hit_rates(node: dict[str, Any]) -> tuple[str, str]:
    """A node's prefix cache hit rates (tokens, requests) since it started; '-' when none."""
    def pct(hits: Any, queries: Any) -> str:
        return f"{100.0 * hits / queries:.1f}%" if queries else "-"

    return (pct(node.get("prefix_hit_tokens", 0), node.get("prefix_query_tokens", 0)),
            pct(node.get("prefix_hit_requests", 0), node.get("prefix_requests", 0)))


def cmd_status(args: Any) -> int:
    import ray

    from deploy.config import ServiceConfig
    from deploy.service import init_ray

    cfg = ServiceConfig.load(None, {"cluster.address": args.address, "cluster.namespace": args.namespace})
    init_ray(cfg)
    try:
        state = collect(timeout_s=args.timeout)
    finally:
        ray.shutdown()
    print(json.dumps(state, indent=1, default=str) if args.json else render(state))
    return 0 if state["router"] and state["router"].get("serving") else 1
