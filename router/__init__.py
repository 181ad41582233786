"""The router: gRPC front door (client API in protos/pdserve.proto), tokenization and
detokenization, prefill/decode node selection, and every request's lifecycle.

Files, in the order a request meets them: validate.py (request -> Prepared), policy.py
(which node), admission.py (the bounded wait for a decode node), pool.py (node connections,
health, the one Outputs subscription per decode node), request.py (per-request state and the
one-terminal guarantee), detokenize.py (text deltas, stop strings), router.py (Router: the
server and the lifecycle), directory.py (NodeDirectory: membership), client.py (a client).
No Ray in here: deploy wraps Router in an actor.
"""

from router.directory import NodeDirectory
from router.policy import LeastLoad, Policy, PrefixAware, RoundRobin, make_policy
from router.router import Router

__all__ = ["LeastLoad", "NodeDirectory", "Policy", "PrefixAware", "RoundRobin", "Router", "make_policy"]
