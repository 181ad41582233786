"""One node of TP size N on Ray: a placement group (STRICT_PACK, one bundle per rank with the
node's CPUs, GPUs and resources) and one TPRankActor per rank.

The ranks live and die together: an actor never restarts on its own (a lone restarted rank
could not rejoin its group). `poll` asks every rank whether it is alive; when one is not, the
group failed to start, or a rank has not answered for the service's SLOW_GRACE_S (one late answer
on a loaded host is no failure), it kills the whole group and launches a new one, and answers
None (the node is down: the service takes it out of the router's directory) until every rank of
the new group has joined and rank 0 serves again, at a new address.
"""

from __future__ import annotations

import logging
import time
from typing import Any

log = logging.getLogger(__name__)


class TPNodeGroup:
    def __init__(self, role: str, index: int, config_json: str, size: int, options: dict[str, Any]) -> None:
        self.role, self.index, self.size = role, index, size
        self.config_json, self.options = config_json, options  # options: the rank actors' Ray options
        self.pg: Any = None
        self.ranks: list[Any] = []
        self._joining: list[Any] = []  # refs of the ranks' join calls; [] once every rank has joined
        self.launches = 0
        self._address: str | None = None  # rank 0's, as last answered by every rank
        self._answered: float | None = None  # when (time.monotonic())

    def bundle(self) -> dict[str, float]:
        b = {"CPU": float(self.options.get("num_cpus") or 0), **self.options.get("resources", {})}
        if self.options.get("num_gpus"):
            b["GPU"] = float(self.options["num_gpus"])
        return {k: v for k, v in b.items() if v}

    def launch(self) -> None:
        """Create the placement group and the rank actors, and start their joining (not waited on)."""
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from deploy.actors import TPRankActor

        self.pg = placement_group([self.bundle()] * self.size, strategy="STRICT_PACK")
        node_id = f"{self.role}-{self.index}"
        self.ranks = []
        for r in range(self.size):
            strategy = PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=r)
            name = self.options["name"] + (f"-g{self.launches}" if self.launches else "") + (f"-rank{r}" if r else "")
            opts = {**self.options, "name": name, "max_restarts": 0, "scheduling_strategy": strategy}
            opts.pop("resources", None)  # inside the bundle
            self.ranks.append(ray.remote(TPRankActor).options(**opts).remote(
                self.role, node_id, self.config_json, r, self.size))
        address = self.ranks[0].rendezvous.remote()
        self._joining = [h.join.remote(address) for h in self.ranks]
        self.launches += 1
        self._address = self._answered = None

    def poll(self, wait_s: float, grace_s: float = 0.0) -> str | None:
        """Rank 0's address when every rank is up; None while (re)starting. Relaunches a broken
        group: a rank died, or the ranks have not all answered for `grace_s` (alive but slow, as on
        a loaded host, the group keeps its address until then: a restart would end its requests)."""
        import ray

        if self._joining:
            done, _ = ray.wait(self._joining, num_returns=len(self._joining), timeout=0)
            if len(done) < len(self._joining):
                return None
            try:
                ray.get(self._joining)
            except Exception as exc:
                self._relaunch(f"did not start: {exc}")
                return None
            self._joining = []
            self._answered = time.monotonic()  # every rank joined: alive, its first late answer is no failure
        try:
            addresses = ray.get([h.address.remote() for h in self.ranks], timeout=wait_s)
        except ray.exceptions.GetTimeoutError:
            if self._answered is not None and time.monotonic() - self._answered < grace_s:
                return self._address
            self._relaunch(f"a rank has not answered for {grace_s:.0f} s")
            return None
        except Exception as exc:
            self._relaunch(f"a rank is down: {exc}")
            return None
        self._address, self._answered = str(addresses[0]), time.monotonic()
        return self._address

    def _relaunch(self, why: str) -> None:
        log.warning("TP group %s-%d %s; restarting the whole group", self.role, self.index, why)
        self.kill_all()
        self.launch()

    def kill(self, rank: int) -> None:
        """Kill one rank's process (for fault drills and tests); `poll` restarts the group."""
        import ray

        ray.kill(self.ranks[rank], no_restart=True)

    def info(self) -> dict[str, Any]:
        """Rank 0's info with `ranks`: every rank's."""
        import ray

        every = ray.get([h.info.remote() for h in self.ranks], timeout=30)
        return {**every[0], "ranks": every}

    def kill_all(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        for h in self.ranks:
            ray.kill(h, no_restart=True)
        if self.pg is not None:
            remove_placement_group(self.pg)
        self.ranks, self.pg, self._joining = [], None, []

    def stop(self) -> None:
        import ray

        for h in self.ranks:
            try:
                ray.get(h.stop.remote(), timeout=10)
            except Exception:
                pass  # dead already: killing it is enough
        self.kill_all()
