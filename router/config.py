"""RouterConfig: the router's own settings, the `router:` section of a service's config.

It lives with the router so the router depends on nothing above it; deploy/config.py gathers it
into ServiceConfig (YAML, CLI overrides, unknown keys as errors). Imports only pydantic.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class RouterConfig(BaseModel):
    """The `router:` section of a service's config (deploy/config.py gathers the sections)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # Where the gRPC and HTTP ports bind: loopback unless told (0.0.0.0: every interface; 'auto':
    # the Ray node's IP, what deploy/ configs use).
    host: str = "127.0.0.1"
    port: int = Field(default=50051, ge=0, le=65535)  # gRPC; 0: any free port
    http_port: int | None = Field(default=8000, ge=0, le=65535)  # OpenAI-compatible HTTP; None: off
    # prefix: the prefill node likely to hold the prompt's longest prefix, unless the load is
    # unbalanced (router/policy.py); decode nodes by least load.
    policy: Literal["least_load", "round_robin", "prefix"] = "least_load"
    # prefix policy: prefill loads (queued prompt tokens) count as unbalanced when the busiest
    # exceeds the idlest by more than `prefix_balance_abs_tokens` and by `prefix_balance_rel` times;
    # then the least loaded node gets the request, whatever it caches.
    prefix_balance_abs_tokens: int = Field(default=2048, ge=0)
    prefix_balance_rel: float = Field(default=1.5, ge=1.0)
    prefix_view_blocks: int = Field(default=65536, gt=0)  # per prefill node: block hashes remembered
    # Router processes sharing the gRPC and HTTP ports (SO_REUSEPORT: the kernel spreads client
    # connections over them), as vLLM's --api-server-count: each its own event loop, core, queue and
    # output streams; /metrics sums them all. `--router-processes N`.
    processes: int = Field(default=1, ge=1, le=64)
    queue_size: int = Field(default=256, ge=0)  # requests waiting for a decode node; 0: no queue
    default_timeout_s: float = Field(default=600.0, gt=0)  # per request, when it gives none
    max_prompt_bytes: int = Field(default=1 << 20, gt=0)  # prompt text over this: INVALID_ARGUMENT
    status_interval_s: float = Field(default=1.0, gt=0)  # node Status polls and health probes
    rpc_timeout_s: float = Field(default=5.0, gt=0)  # Reserve / Abort / Status calls to nodes
    # A node that answered before stays selectable through this many Status calls in a row that
    # run past their deadline (a node busy with a long prefill answers late; Kubernetes' probe
    # failureThreshold is 3 as well). A refused connection (UNAVAILABLE) takes it out at once.
    status_failure_threshold: int = Field(default=3, ge=1)
    prefill_retries: int = Field(default=2, ge=0)  # other prefill nodes tried after UNAVAILABLE
    # PD: reserve on the decode node while the prefill node computes (its Prefill request carries no
    # KV descriptor; an Attach call brings it), so the first token does not wait for the
    # reservation (~2 ms of gRPC). Only while no request waits in the router's queue; when no
    # decode node admits, the prefill is given up and the request reserves first, as with False.
    overlap_reserve: bool = True
    # A request whose decode node is lost moves to another one: prompt + the tokens already
    # streamed are prefilled again and the stream goes on (each token once); at most
    # `max_migrations` times per request, then UNAVAILABLE. False: such requests end UNAVAILABLE.
    migrate: bool = True
    max_migrations: int = Field(default=3, ge=0)
    # With no healthy prefill or decode node, a new request waits this long for one before
    # UNAVAILABLE: long enough to ride out a node's restart (a model load) and a service's start,
    # whose router serves before its nodes are up. 0: answer at once. Bounded by the request's own
    # deadline too.
    node_wait_s: float = Field(default=60.0, ge=0)
    # Clients must send `authorization: Bearer KEY` (gRPC metadata, HTTP header) for generation
    # and models; health checks and /metrics stay open. None: no auth. `--api-key` or PDSERVE_API_KEY.
    api_key: str | None = Field(default=None, min_length=1, repr=False)
    # TLS on the gRPC and HTTP ports: a PEM certificate chain and its private key (both or
    # neither; `--tls-cert`/`--tls-key`, vLLM's `--ssl-certfile`/`--ssl-keyfile`). None: plain text.
    tls_cert: str | None = Field(default=None, min_length=1)
    tls_key: str | None = Field(default=None, min_length=1)
    # Tool calling (router/tool_api.py), named as vLLM's flags: `--tool-call-parser` picks the syntax
    # the model writes its calls in (hermes: <tool_call>{json}</tool_call>; llama3_json), and
    # `--enable-auto-tool-choice` lets it decide whether to call (tool_choice "auto"). "required"
    # and named calls need neither: the grammar writes them as JSON.
    tool_call_parser: Literal["hermes", "llama3_json"] | None = None
    enable_auto_tool_choice: bool = False

    @model_validator(mode="after")
    def _auto_tools_with_parser(self) -> RouterConfig:
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice needs tool_call_parser (hermes or llama3_json)")
        return self

    @model_validator(mode="after")
    def _cert_with_key(self) -> RouterConfig:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together (give both, or neither)")
        return self
