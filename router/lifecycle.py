"""Lifecycle: what a front door (grpc_door.py, http.py) sees of the router.

A door turns its protocol's request into a `GenerateRequest`, hands it to `submit`, and reads
`responses` until the terminal message (closing it early cancels the request); so validation,
queueing, abort and the one-terminal rule live once, in router.py, behind this protocol.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any, Protocol

from protos import pdserve_pb2 as pb
from router.config import RouterConfig
from router.metrics import RouterMetrics
from router.request import RequestState
from router.ttft import Timeline
from router.validate import Limits


class Lifecycle(Protocol):
    """What the front doors use of the request lifecycle (router.py's `Router`, which passes itself
    to `build_app` and `grpc_door.serve`)."""

    config: RouterConfig
    model: Any  # engine.model.info.ModelInfo: name, tokenizer
    limits: Limits
    metrics: RouterMetrics
    max_model_len: int

    async def submit(self, request: pb.GenerateRequest, timeline: Timeline | None = None) -> RequestState: ...
    def responses(self, st: RequestState) -> AsyncGenerator[pb.GenerateResponse, None]: ...
    def refused(self, code: str) -> None: ...
    async def metrics_text(self) -> tuple[bytes, str]: ...
    def health(self, nodes: bool = False) -> pb.HealthResponse: ...
    def health_detail_allowed(self, authorization: str | None) -> bool: ...
    def list_models(self) -> pb.ListModelsResponse: ...
    async def abort(self, request_id: str) -> bool: ...
