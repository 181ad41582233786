"""Service configuration: one frozen pydantic model per component, gathered in ServiceConfig.

Receives a YAML file (optional) and CLI overrides as dotted keys (`decode.num_nodes: 4`);
hands on a validated, immutable `ServiceConfig`. Unknown keys, at any depth, are errors
that name the key and list the known ones. Nothing here imports torch, Ray or gRPC, so
every component (router included) can read its own section cheaply.

YAML layout (every section and key optional):

    model: {name: tiny, load_format: auto, dtype: auto, device: auto, max_model_len: 2048, mtp_path: null,
            enforce_eager: false, deterministic: false, warmup: true}
    spec: {num_speculative_tokens: 2, draft_vocab_size: 0}
    cache: {block_size: 16, num_blocks: null, kv_cache_bytes: 536870912}
    kv_transfer: {backend: ucx, timeout_s: 30, faults: {drop: 0, delay: 0, duplicate: 0, truncate: 0}}
    prefill: {max_num_batched_tokens: 2048, tp: 1, num_nodes: 1, num_cpus: 1, num_gpus: 1, resources: {},
              prefix_cache: false}
    decode: {max_num_seqs: 32, tp: 1, num_nodes: 1, num_cpus: 1, num_gpus: 1, resources: {}, prefix_cache: false}
    colocated: {num_nodes: 0, max_num_seqs: 32, max_num_batched_tokens: 512, num_cpus: 1, num_gpus: 1, resources: {},
                prefix_cache: false}
    router: {host: 127.0.0.1, port: 50051, http_port: 8000, policy: least_load, queue_size: 256, default_timeout_s: 600,
             api_key: null, tls_cert: null, tls_key: null, migrate: true, max_migrations: 3, ...}
    cluster: {address: null, namespace: pdserve, router_resources: {}, node_host: 127.0.0.1, start_timeout_s: 300,
              secret: null, secret_file: null, node_tls_ca: null, node_tls_cert: null, node_tls_key: null,
              node_tls_name: pdserve-node}

A service is disaggregated (prefill and decode nodes) or colocated (`colocated.num_nodes` > 0:
nodes that each prefill and decode their own requests; prefill and decode nodes are then not
started, and their `num_nodes` default to 0, any other count being an error).

`router.host: auto` and `cluster.node_host: auto` bind the Ray node's own IP (multi-host).
`resources` are Ray custom resources (`ray start --resources`, `resources:` of a `ray up` node
type): with `{pdserve_decode: 1}` decode actors run only on nodes that offer it.
"""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

import settings
from router.config import RouterConfig  # the router's own section, gathered (and re-exported) here

DTYPE_NAMES = ("auto", "float32", "fp32", "bfloat16", "bf16", "float16", "fp16")


class ConfigError(ValueError):
    """A config file or override that is unreadable, has unknown keys or bad values."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelConfig(_Section):
    name: str | None = None  # 'tiny', 'smollm2', a HF dir or a .gguf file; None: the embedded default
    # vLLM's: 'dummy' gives random weights of `name`'s shape, a named one (llama-3.1-8b, ...) or a model's
    load_format: Literal["auto", "dummy"] = "auto"
    dtype: str = "auto"
    device: str = "auto"  # 'auto': cuda when available, else cpu
    max_model_len: int | None = Field(default=None, gt=0)  # None: min(model's positions, 4096)
    mtp_path: str | None = None
    enforce_eager: bool = False  # no CUDA graphs for the decode step (as vLLM's --enforce-eager)
    deterministic: bool = False  # batch-invariant kernels on prefill and decode nodes alike
    warmup: bool = True  # capture the CUDA graphs requests meet before a node is ready (engine/runner/warmup.py)

    @field_validator("dtype")
    @classmethod
    def _known_dtype(cls, v: str) -> str:
        if v not in DTYPE_NAMES:
            raise ValueError(f"must be one of {', '.join(DTYPE_NAMES)}, got {v!r}")
        return v

    def resolved_name(self) -> str:
        from engine.model.paths import default_model

        return self.name or default_model()

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"


class SpecConfig(_Section):
    num_speculative_tokens: int = Field(default=0, ge=0)  # k MTP draft tokens per step
    # drafts score the N most frequent tokens (FR-Spec); 0: all; None: 32768 where V is larger and a ranking ships
    draft_vocab_size: int | None = Field(default=None, ge=0)
    # fixed: every decode step verifies k drafts; adaptive: k or 0 per step (engine/spec_decode/adaptive_k.py)
    k_policy: Literal["fixed", "adaptive"] = "fixed"


class CacheConfig(_Section):
    block_size: int = Field(default=16, gt=0)
    num_blocks: int | None = Field(default=None, gt=0)  # overrides kv_cache_bytes when set
    kv_cache_bytes: int = Field(default=512 << 20, gt=0)


class KVFaultsConfig(_Section):
    """Fault drills only (`pdserve bench chaos`): prefill nodes' KV links drop, delay, duplicate or
    truncate (tcp only) each message with these probabilities (kvtransfer/faults.py). All 0: off."""

    drop: float = Field(default=0.0, ge=0, le=1)
    delay: float = Field(default=0.0, ge=0, le=1)
    duplicate: float = Field(default=0.0, ge=0, le=1)
    truncate: float = Field(default=0.0, ge=0, le=1)
    delay_s: float = Field(default=0.05, ge=0)  # a delayed message waits up to this long

    @property
    def any(self) -> bool:
        return bool(self.drop or self.delay or self.duplicate or self.truncate)

    @model_validator(mode="after")
    def _at_most_one(self) -> KVFaultsConfig:
        if self.drop + self.delay + self.duplicate + self.truncate > 1:
            raise ValueError("the fault probabilities must sum to at most 1")
        return self


class KVTransferConfig(_Section):
    backend: Literal["ucx", "tcp", "ipc", "local"] = "ucx"
    timeout_s: float = Field(default=30.0, gt=0)
    faults: KVFaultsConfig = Field(default_factory=KVFaultsConfig)


class _NodeSection(_Section):
    """A node kind's section: its `tp` (tensor-parallel ranks per node, one GPU each) is a power of two."""

    @field_validator("tp", check_fields=False)
    @classmethod
    def _power_of_two(cls, v: int) -> int:
        if v < 1 or v & (v - 1):
            raise ValueError(f"must be a power of two (1, 2, 4, ...), got {v}")
        return v


class PrefillConfig(_NodeSection):
    max_num_batched_tokens: int = Field(default=2048, gt=0)
    tp: int = 1  # must equal decode.tp
    num_nodes: int = Field(default=1, ge=0)  # 0 only in a colocated service
    num_cpus: float = Field(default=1.0, ge=0)
    num_gpus: float = Field(default=1.0, ge=0)
    resources: dict[str, float] = Field(default_factory=dict)  # Ray resources each node needs ({pdserve_prefill: 1})
    # Keep computed KV blocks of prompts and start a prompt after its longest cached prefix
    # (engine/cache/prefix_cache.py); pair with `router.policy: prefix`. `--enable-prefix-caching`.
    prefix_cache: bool = False


class DecodeConfig(_NodeSection):
    max_num_seqs: int = Field(default=32, gt=0)
    tp: int = 1  # must equal prefill.tp
    num_nodes: int = Field(default=1, ge=0)  # 0 only in a colocated service
    num_cpus: float = Field(default=1.0, ge=0)
    num_gpus: float = Field(default=1.0, ge=0)
    resources: dict[str, float] = Field(default_factory=dict)  # Ray resources each node needs ({pdserve_decode: 1})
    # Keep received KV blocks of prompts; at Reserve the prompt's cached prefix is taken from here
    # and only the rest crosses the wire (decode_node/node.py).
    prefix_cache: bool = False


class ColocatedConfig(_Section):
    """Nodes that each prefill and decode their own requests with one engine (no KV transfer):
    decode_node/colocated.py. `num_nodes` > 0 makes the service colocated."""

    num_nodes: int = Field(default=0, ge=0)
    max_num_seqs: int = Field(default=32, gt=0)  # requests running at once per node (as vLLM's)
    # Prompt tokens one loop round computes (chunks of one or more prompts) before the round's
    # decode step, as vLLM's --max-num-batched-tokens bounds a step: a running request waits at most
    # one such chunk between two of its steps. Smaller: steadier inter-token latency, slower prefill.
    max_num_batched_tokens: int = Field(default=512, gt=0)
    num_cpus: float = Field(default=1.0, ge=0)
    num_gpus: float = Field(default=1.0, ge=0)
    resources: dict[str, float] = Field(default_factory=dict)  # Ray resources each node needs
    prefix_cache: bool = False  # keep computed prompt blocks (engine/cache/prefix_cache.py); --enable-prefix-caching


class ClusterConfig(_Section):
    address: str | None = None  # Ray address; None: start a local Ray
    namespace: str = "pdserve"
    router_resources: dict[str, float] = Field(default_factory=dict)  # Ray resources the router needs
    # where node gRPC servers and KV listeners bind (tcp: this address; ucx: loopback only when it
    # is a loopback address); 'auto': the Ray node's IP
    node_host: str = "127.0.0.1"
    start_timeout_s: float = Field(default=300.0, gt=0)  # `pdserve up` waits this long for every node
    # Shared by the router and the nodes: every node RPC must carry it. None: `secret_file`, else
    # $PDSERVE_CLUSTER_SECRET, else `pdserve up` makes one (with_cluster_secret). Never logged.
    secret: str | None = Field(default=None, min_length=16, repr=False)
    secret_file: str | None = None  # a file holding it (e.g. a mounted Kubernetes Secret)
    # Mutual TLS on the node control channels (protos/tls.py): PEM files of the cluster CA and of
    # the node certificate chain and its key (all three or none; `--node-tls-ca/-cert/-key`). Every
    # process (router, nodes) reads them at these paths on its own host: in Kubernetes, a Secret
    # holding ca.crt, tls.crt and tls.key mounted in every pod. The certificate must name
    # `node_tls_name` (subjectAltName DNS): nodes are checked against it, not their IPs.
    # `pdserve certs --out DIR` makes a development set. None: plain text (the secret still applies).
    node_tls_ca: str | None = Field(default=None, min_length=1)
    node_tls_cert: str | None = Field(default=None, min_length=1)
    node_tls_key: str | None = Field(default=None, min_length=1)
    node_tls_name: str = Field(default="pdserve-node", min_length=1)

    @model_validator(mode="after")
    def _one_secret(self) -> ClusterConfig:
        if self.secret is not None and self.secret_file is not None:
            raise ValueError("give cluster.secret or cluster.secret_file, not both")
        return self

    @model_validator(mode="after")
    def _node_tls_files_together(self) -> ClusterConfig:
        given = [f is not None for f in (self.node_tls_ca, self.node_tls_cert, self.node_tls_key)]
        if any(given) and not all(given):
            raise ValueError("node_tls_ca, node_tls_cert and node_tls_key go together (give all three, or none)")
        return self

    @property
    def node_tls(self) -> bool:
        return self.node_tls_cert is not None


class ServiceConfig(_Section):
    model: ModelConfig = Field(default_factory=ModelConfig)
    spec: SpecConfig = Field(default_factory=SpecConfig)
    cache: CacheConfig = Field(default_factory=CacheConfig)
    kv_transfer: KVTransferConfig = Field(default_factory=KVTransferConfig)
    prefill: PrefillConfig = Field(default_factory=PrefillConfig)
    decode: DecodeConfig = Field(default_factory=DecodeConfig)
    colocated: ColocatedConfig = Field(default_factory=ColocatedConfig)
    router: RouterConfig = Field(default_factory=RouterConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)

    @model_validator(mode="before")
    @classmethod
    def _one_mode(cls, data: Any) -> Any:
        """In a colocated service prefill and decode `num_nodes` default to 0; other counts are errors."""
        if not isinstance(data, dict) or not isinstance(data.get("colocated"), dict):
            return data
        colocated = data["colocated"].get("num_nodes", 0)
        if not isinstance(colocated, int) or colocated <= 0:
            return data
        data = dict(data)
        for role in ("prefill", "decode"):
            section = data.get(role, {})
            if not isinstance(section, dict):
                continue
            given = section.get("num_nodes", 0)
            if given != 0:
                raise ValueError(f"colocated.num_nodes ({colocated}) and {role}.num_nodes ({given}) are both set: a "
                                 "service is colocated or disaggregated (leave prefill and decode num_nodes unset)")
            data[role] = {**section, "num_nodes": 0}
        return data

    @model_validator(mode="after")
    def _nodes_to_run(self) -> ServiceConfig:
        if self.colocated.num_nodes == 0:
            for role, section in (("prefill", self.prefill), ("decode", self.decode)):
                if section.num_nodes == 0:
                    raise ValueError(f"{role}.num_nodes must be >= 1 (or set colocated.num_nodes for a colocated "
                                     "service)")
        return self

    @property
    def node_counts(self) -> dict[str, int]:
        """Nodes to start per role (prefill, decode, colocated), zero counts left out."""
        counts = {"prefill": self.prefill.num_nodes, "decode": self.decode.num_nodes,
                  "colocated": self.colocated.num_nodes}
        return {role: n for role, n in counts.items() if n}

    def section(self, role: str) -> PrefillConfig | DecodeConfig | ColocatedConfig:
        """The config section of a node role."""
        sections: dict[str, PrefillConfig | DecodeConfig | ColocatedConfig] = {
            "prefill": self.prefill, "decode": self.decode, "colocated": self.colocated}
        if role not in sections:
            raise ValueError(f"unknown node role {role!r}")
        return sections[role]

    @model_validator(mode="after")
    def _same_tp(self) -> ServiceConfig:
        if self.prefill.tp != self.decode.tp:
            raise ValueError(f"prefill.tp ({self.prefill.tp}) and decode.tp ({self.decode.tp}) differ: each prefill "
                             "rank sends its KV-head shard to the decode rank of the same index, so both must be equal")
        return self

    @classmethod
    def load(cls, path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> ServiceConfig:
        """Read `path` (YAML; None: defaults only), then apply `overrides` ({"decode.num_nodes": 4})."""
        data: dict[str, Any] = {}
        if path is not None:
            data = _read_yaml(Path(path))
        for key, value in (overrides or {}).items():
            _set_dotted(data, key, value)
        _check_keys(cls, data, "")
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            raise ConfigError(_describe(e, path)) from None


def with_cluster_secret(cfg: ServiceConfig, env_secret: str | None = settings.CLUSTER_SECRET) -> ServiceConfig:
    """`cfg` with `cluster.secret` resolved: as given, else read from `cluster.secret_file`, else
    `env_secret` ($PDSERVE_CLUSTER_SECRET), else a new random one (this service's own)."""
    c = cfg.cluster
    secret = c.secret
    if secret is None and c.secret_file is not None:
        secret = _read_secret(Path(c.secret_file))
    if secret is None:
        secret = env_secret or secrets.token_urlsafe(32)
    if len(secret) < 16:
        raise ConfigError("the cluster secret must be at least 16 characters")
    return cfg.model_copy(update={"cluster": c.model_copy(update={"secret": secret, "secret_file": None})})


def _read_secret(path: Path) -> str:
    try:
        secret = path.read_text().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read the cluster secret file {path}: {getattr(e, 'strerror', None) or e}") from None
    if not secret:
        raise ConfigError(f"the cluster secret file {path} is empty")
    return secret


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """CLI `KEY=VALUE` strings -> overrides; values are read as YAML scalars (`4`, `null`, `true`)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r} is not KEY=VALUE (e.g. decode.num_nodes=2)")
        try:
            out[key.strip()] = yaml.safe_load(raw) if raw.strip() else raw
        except yaml.YAMLError:
            out[key.strip()] = raw
    return out


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of sections, not {type(data).__name__}")
    return data


def _set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    if any(not p for p in parts):
        raise ConfigError(f"bad override key {key!r}")
    node = data
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {key!r}: {'.'.join(parts[: i + 1])} is not a section")
        node = child
    node[parts[-1]] = value


def _check_keys(model: type[BaseModel], data: Any, prefix: str) -> None:
    """Unknown keys, with the known ones listed (pydantic's own message lists neither)."""
    if not isinstance(data, dict):
        return
    fields = model.model_fields
    for key, value in data.items():
        name = f"{prefix}{key}"
        if key not in fields:
            where = f"in {prefix[:-1]!r}" if prefix else "at the top level"
            raise ConfigError(f"unknown config key {name!r} {where}; known: {', '.join(fields)}")
        sub = fields[key].annotation
        if isinstance(sub, type) and issubclass(sub, BaseModel):
            if not isinstance(value, dict):
                raise ConfigError(f"config section {name!r} must be a mapping, got {value!r}")
            _check_keys(sub, value, f"{name}.")


def _describe(e: ValidationError, path: str | Path | None) -> str:
    lines = [f"{'.'.join(str(p) for p in err['loc']) or '(root)'}: {err['msg']}" for err in e.errors()]
    source = f" in {path}" if path is not None else ""
    return f"invalid config{source}: " + "; ".join(lines)
