"""The router: gRPC front door (client API in protos/pdserve.proto), tokenization and
detokenization, prefill/decode node selection, and every request's lifecycle.

Files, in the order a request meets them: validate.py (request -> Prepared), router.py (Router: the
server and each request's driver), grpc_door.py and http.py (the front doors), admission.py
(reserve on a decode node, or wait in the bounded queue), placement.py (which P and D, the Prefill
request), prefill_stream.py (the one PrefillStream per prefill node), policy.py (node order),
holds.py (what nodes hold for a request, Aborts), migration.py (moving a request off a lost decode
node), stream.py (output items -> client messages), pool.py (node connections, health, the one
Outputs subscription per decode node), request.py (per-request state and the one-terminal
guarantee), detokenize.py (text deltas, stop strings), directory.py (NodeDirectory: membership),
config.py (RouterConfig), client.py (a client).
The OpenAI door's request and response shapes: openai_protocol.py, with openai_surface.py,
structured_api.py, and tool calling in tool_api.py (tools -> prompt and grammar), tool_parser.py
(calls read back from a model's text) and tool_output.py (OpenAI's tool_calls).
No Ray in here: deploy wraps Router in an actor.

`Router` is imported on first use, so reading `router.config` (deploy/config.py does, for
ServiceConfig) does not load gRPC and the HTTP server.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from router.directory import NodeDirectory
from router.policy import LeastLoad, Policy, PrefixAware, RoundRobin, make_policy

if TYPE_CHECKING:
    from router.router import Router

__all__ = ["LeastLoad", "NodeDirectory", "Policy", "PrefixAware", "RoundRobin", "Router", "make_policy"]


def __getattr__(name: str) -> Any:
    if name == "Router":
        from router.router import Router

        return Router
    raise AttributeError(f"module 'router' has no attribute {name!r}")
