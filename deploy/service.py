"""Service: assembles router + N prefill + M decode actors (or N colocated ones) on Ray and keeps them wired.

Starts Ray (a local cluster, or joins `cluster.address`), creates the node actors (each
restarts forever on death, placed only on Ray nodes offering the section's `resources`) and
the router actor, all named `pdserve-...` in the namespace (`pdserve status` finds them),
then watches: every `status_interval_s` it asks each node actor for its address; a node whose
actor is gone, or that has not answered for SLOW_GRACE_S (alive but slow, as on a loaded host, it
keeps its place until then), is taken out of the router's directory, and one that answers again
(restarted: a new port) is put back. A node of
TP size N > 1 is a placement group of N rank actors (deploy/tp_group.py): it answers when all
its ranks do, and a rank's death restarts the whole group.

With `router.processes` N > 1 there are N router actors (pdserve-router, pdserve-router-1, ...)
serving the same ports (SO_REUSEPORT: the kernel spreads client connections over them), each with
its own subscriptions to every decode node and its own queue; each is told the others, whose
/metrics it sums into its own. Each is watched as below; `router_restarts` counts the first one's.

The router actor restarts forever too. Each round the watcher hands it the node list and asks
it to serve (`ensure_serving`) on the ports it first bound, so a router Ray restarted re-discovers
its nodes and serves again at the same address (`router_restarts` counts the new instances). Its
requests in flight die with it (clients see UNAVAILABLE; nodes drop them: deploy/router_actor.py).
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from typing import Any

from deploy.actors import node_tls
from deploy.config import ServiceConfig, with_cluster_secret
from deploy.tp_group import TPNodeGroup

ROLES = ("prefill", "decode", "colocated")
ACTOR_PREFIX = "pdserve-"  # actors are named pdserve-router, pdserve-prefill-0, ... in the namespace
SLOW_GRACE_S = 5.0  # how long a node actor that answers too slowly keeps its place in the directory
log = logging.getLogger(__name__)


def actor_name(what: str) -> str:
    return f"{ACTOR_PREFIX}{what}"


def init_ray(cfg: ServiceConfig, temp_dir: str | None = None, num_cpus: int | None = None) -> None:
    import ray

    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # bind loopback, not the outward address
    os.environ.setdefault("RAY_gcs_server_port_wait_time_s", "120")  # slow GCS start on a loaded small machine
    if ray.is_initialized():
        return
    kwargs: dict[str, Any] = {"namespace": cfg.cluster.namespace, "include_dashboard": False,
                              "log_to_driver": False, "configure_logging": False}
    if cfg.cluster.address is None:
        kwargs.update(address="local", num_cpus=num_cpus or local_cpus(cfg), _temp_dir=temp_dir)
    else:
        kwargs["address"] = cfg.cluster.address
        ray.init(**kwargs)
        return
    # A local cluster is ours to start again, and on a loaded small machine its start can
    # fail once: seen here, a raylet missing Ray's fixed 30 s to register with the GCS, and
    # a GCS that never published its port (no log written) within 120 s.
    for attempt in range(3):
        try:
            ray.init(**kwargs)
            return
        except Exception as exc:
            if attempt == 2:
                raise
            log.warning("local Ray cluster did not start (%s); starting it again", exc)
            ray.shutdown()


def local_cpus(cfg: ServiceConfig) -> int:
    """The logical CPUs of a local cluster: what its node actors take, and two spare. Not the host's
    cores: Ray starts one worker process per logical CPU as the driver connects, and on a host of
    many cores those dozens of processes start beside the nodes' own, on the way to ready."""
    needed = sum(n * getattr(cfg.section(role), "tp", 1) * cfg.section(role).num_cpus
                 for role, n in cfg.node_counts.items())
    return math.ceil(needed) + 2


def gpus_needed(cfg: ServiceConfig) -> float:
    """GPUs the service's nodes take when it runs on GPUs: per node, `num_gpus` (default 1) per TP rank.
    `--prefill P --decode D` at TP t is (P + D) x t GPUs, `--colocated N` is N."""
    return sum(n * getattr(cfg.section(role), "tp", 1) * cfg.section(role).num_gpus
               for role, n in cfg.node_counts.items())


def check_gpus_fit(cfg: ServiceConfig) -> None:
    """On a local cluster, a layout wanting more GPUs than the host has is an error before any actor
    starts, not node actors pending until the start times out."""
    import ray

    if cfg.cluster.address is not None or not cfg.model.resolved_device().startswith("cuda"):
        return
    have, want = ray.cluster_resources().get("GPU", 0.0), gpus_needed(cfg)
    if want > have:
        counts = ", ".join(f"{n} {role}" for role, n in cfg.node_counts.items())
        raise ValueError(f"the service's nodes ({counts}) take {want:g} GPUs (num_gpus per node and TP rank), "
                         f"and this host has {have:g}")


class Service:
    def __init__(self, cfg: ServiceConfig) -> None:
        self.cfg = with_cluster_secret(cfg)  # router and nodes share it; made here when not given
        node_tls(self.cfg)  # node TLS files checked here first: a clear error before any actor starts
        self.actors: dict[tuple[str, int], Any] = {}
        self.addresses: dict[tuple[str, int], str | None] = {}
        self._answered: dict[tuple[str, int], float] = {}  # when each node actor last gave its address
        self.router: Any = None  # the first router actor (`pdserve status` asks it)
        self.routers: list[Any] = []  # every router actor (router.processes), the first one first
        self.router_address = ""
        self.http_address: str | None = None  # host:port of the router's HTTP door
        self.router_restarts = 0  # router instances after the first seen serving (Ray restarted it)
        self._router_instance = ""
        self._router_ports: tuple[int, int | None] = (0, None)  # gRPC, HTTP: kept across restarts
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None
        self.startup: dict[str, float] = {}  # seconds from `start` to: router serving, every node serving

    def start(self, timeout_s: float = 300.0) -> str:
        """Create every actor, wait until all serve, start watching; returns the router address."""
        import ray

        from deploy.actors import NodeActor
        from deploy.router_actor import RouterActor

        check_gpus_fit(self.cfg)
        t0 = time.perf_counter()
        cfg_json = self.cfg.model_dump_json()
        for role, count in self.cfg.node_counts.items():
            tp = getattr(self.cfg.section(role), "tp", 1)
            for i in range(count):
                if tp > 1:
                    self.actors[(role, i)] = TPNodeGroup(role, i, cfg_json, tp, self._node_options(role, i))
                    self.actors[(role, i)].launch()
                    continue
                self.actors[(role, i)] = ray.remote(NodeActor).options(**self._node_options(role, i)).remote(
                    role, f"{role}-{i}", cfg_json)
        self.routers = [ray.remote(RouterActor).options(
            num_cpus=0, max_restarts=-1, name=actor_name("router" if i == 0 else f"router-{i}"),
            resources=dict(self.cfg.cluster.router_resources)).remote(cfg_json) for i in range(self.cfg.router.processes)]
        self.router = self.routers[0]
        self.router_address = ray.get(self.router.start.remote(), timeout=timeout_s)
        self.http_address = ray.get(self.router.http_address.remote(), timeout=timeout_s)
        self._router_ports = (_port(self.router_address), _port(self.http_address) if self.http_address else None)
        if len(self.routers) > 1:  # the others bind the same ports (SO_REUSEPORT) and know each other
            ray.get([h.ensure_serving.remote(*self._router_ports, self._peers(i)) for i, h in enumerate(self.routers)],
                    timeout=timeout_s)
        self.startup["router_serving"] = round(time.perf_counter() - t0, 2)
        deadline = time.monotonic() + timeout_s
        want = tuple(self.cfg.node_counts.get(role, 0) for role in ROLES)
        while not all(self._poll_once(wait_s=5.0).values()) or not self._router_sees(want):
            if time.monotonic() > deadline:
                raise TimeoutError(f"nodes did not start in time: {self.addresses}")
            time.sleep(0.1)
        self.startup["nodes_serving"] = round(time.perf_counter() - t0, 2)
        self._watcher = threading.Thread(target=self._watch, name="service-watch", daemon=True)
        self._watcher.start()
        return self.router_address

    def _node_options(self, role: str, index: int) -> dict[str, Any]:
        """Ray options of one node actor: restarts forever, named, only where its resources are."""
        section = self.cfg.section(role)
        gpu = self.cfg.model.resolved_device().startswith("cuda")
        return dict(max_restarts=-1, max_task_retries=0, num_cpus=section.num_cpus,
                    num_gpus=section.num_gpus if gpu else 0, resources=dict(section.resources),
                    name=actor_name(f"{role}-{index}"))

    def _poll_once(self, wait_s: float) -> dict[tuple[str, int], str | None]:
        import ray

        groups = {key: h for key, h in self.actors.items() if isinstance(h, TPNodeGroup)}
        refs = {key: h.address.remote() for key, h in self.actors.items() if key not in groups}
        for key, ref in refs.items():
            self.addresses[key] = self._answer(key, ref, wait_s)
        for key, group in groups.items():  # a TP node is up when all its ranks are; else it restarts
            self.addresses[key] = group.poll(wait_s, SLOW_GRACE_S)
        for role in ROLES:
            live = [a for (r, _), a in sorted(self.addresses.items()) if r == role and a]
            ray.get([h.set_nodes.remote(role, live) for h in self.routers], timeout=60.0)
        peers = [self._peers(i) if len(self.routers) > 1 else None for i in range(len(self.routers))]
        serving = ray.get([h.ensure_serving.remote(*self._router_ports, p) for h, p in zip(self.routers, peers, strict=True)],
                          timeout=60.0)
        self._router_serving(serving[0])
        return dict(self.addresses)

    def _answer(self, key: tuple[str, int], ref: Any, wait_s: float) -> str | None:
        """A node actor's address, or None: its actor died (or is restarting), or it has not
        answered for SLOW_GRACE_S. A call that only timed out keeps the last address until then:
        one late answer on a busy host is no failure (taking the node out moves its requests)."""
        import ray

        try:
            addr = ray.get(ref, timeout=wait_s)
        except ray.exceptions.GetTimeoutError:
            last = self._answered.get(key)
            return self.addresses.get(key) if last is not None and time.monotonic() - last < SLOW_GRACE_S else None
        except Exception:
            return None
        self._answered[key] = time.monotonic()
        return addr

    def _peers(self, i: int) -> list[Any]:
        return [h for j, h in enumerate(self.routers) if j != i]

    def _router_serving(self, instance: str) -> None:
        """Count a new router instance serving (one that Ray restarted), however late the news
        comes: a call that started it may have timed out here, the next one names it."""
        if instance != self._router_instance:
            if self._router_instance:
                self.router_restarts += 1
                log.warning("the router was restarted; serving again on %s", self.router_address)
            self._router_instance = instance

    def _router_sees(self, want: tuple[int, ...]) -> bool:
        import ray

        for seen in ray.get([h.healthy_nodes.remote() for h in self.routers]):
            if not all(h >= w for h, w in zip(seen, want, strict=True)):
                return False
        return True

    def _watch(self) -> None:
        interval = self.cfg.router.status_interval_s
        while not self._stop.wait(interval):
            try:
                self._poll_once(wait_s=interval)
            except Exception:  # Ray hiccup: try again next round
                continue

    def kill(self, role: str, index: int, rank: int = 0) -> None:
        """Kill a node actor's process (Ray restarts it; a TP node's whole group restarts); for
        fault drills and tests."""
        import ray

        handle = self.actors[(role, index)]
        if isinstance(handle, TPNodeGroup):
            handle.kill(rank)
        else:
            ray.kill(handle, no_restart=False)

    def fail_step(self, role: str, index: int) -> None:
        """Make a node's next step raise the error a CUDA fault raises (its process then ends and Ray
        restarts it); for fault drills. A TP node: its group is killed instead (one rank's error
        would leave the others waiting in a collective)."""
        import ray

        handle = self.actors[(role, index)]
        if isinstance(handle, TPNodeGroup):
            handle.kill(0)
            return
        try:
            ray.get(handle.fail_next_step.remote(), timeout=30)
        except (ray.exceptions.ActorUnavailableError, ray.exceptions.RayActorError):
            pass  # the step raised and the process ended before this call's reply went out: as meant

    def kill_router(self) -> None:
        """Kill the router actor's process (Ray restarts it; the watcher makes it serve again)."""
        import ray

        ray.kill(self.router, no_restart=False)

    def node_info(self) -> dict[tuple[str, int], dict]:
        """Each node's info (a TP node: rank 0's, with `ranks`, every rank's)."""
        import ray

        return {key: h.info() if isinstance(h, TPNodeGroup) else ray.get(h.info.remote(), timeout=30)
                for key, h in self.actors.items()}

    def stop(self) -> None:
        import ray

        self._stop.set()
        if self._watcher is not None:
            self._watcher.join(timeout=5)
        for group in [h for h in self.actors.values() if isinstance(h, TPNodeGroup)]:
            group.stop()
        handles = [h for h in self.actors.values() if not isinstance(h, TPNodeGroup)]
        for h in handles + self.routers:
            try:
                ray.get(h.stop.remote(), timeout=10)
            except Exception:
                pass  # already dead: killing it below is enough
            ray.kill(h, no_restart=True)
        self.actors.clear()
        self.router, self.routers = None, []
        _wait_names_free(deadline=time.monotonic() + 30)


def _port(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def _wait_names_free(deadline: float) -> None:
    """Killed actors give their names back once Ray has them dead; the next service reuses them."""
    import ray

    while (any(str(n).startswith(ACTOR_PREFIX) for n in ray.util.list_named_actors())
           and time.monotonic() < deadline):
        time.sleep(0.1)
