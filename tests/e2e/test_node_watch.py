"""The service's node watcher (deploy/service.py) on a real Ray actor: a node actor that answers
late keeps its place in the router's directory for SLOW_GRACE_S (one slow answer on a loaded
host is no failure: taking the node out would move its requests), then loses it; one whose
actor is gone loses it at once."""

from __future__ import annotations

import time

from deploy import service as service_mod
from deploy.config import ServiceConfig
from deploy.service import Service
from tests.e2e.conftest import BASE


class SlowNode:
    def __init__(self) -> None:
        self.delay = 0.0

    def set_delay(self, delay: float) -> None:
        self.delay = delay

    def address(self) -> str:
        time.sleep(self.delay)
        return "127.0.0.1:4242"


def test_a_slow_node_keeps_its_place_for_the_grace_and_a_dead_one_loses_it_at_once(ray_cluster, monkeypatch):
    import ray

    monkeypatch.setattr(service_mod, "SLOW_GRACE_S", 3.0)
    svc = Service(ServiceConfig.load(None, BASE))
    node = ray.remote(SlowNode).options(num_cpus=0, max_concurrency=32).remote()
    key = ("decode", 0)

    def poll() -> str | None:
        svc.addresses[key] = svc._answer(key, node.address.remote(), 0.3)
        return svc.addresses[key]

    ray.get(node.set_delay.remote(0.0), timeout=60)  # started
    assert poll() == "127.0.0.1:4242"
    ray.get(node.set_delay.remote(5.0))
    started = time.monotonic()
    assert poll() == "127.0.0.1:4242"  # timed out, within the grace: kept
    while time.monotonic() - started < 3.1:
        last = poll()
    assert last is None  # no answer for longer than the grace: out
    ray.get(node.set_delay.remote(0.0))
    deadline = time.monotonic() + 10
    while poll() is None:  # answers again: back
        assert time.monotonic() < deadline, "the node did not come back"
    monkeypatch.setattr(service_mod, "SLOW_GRACE_S", 600.0)
    ray.kill(node, no_restart=True)
    deadline = time.monotonic() + 30
    while True:  # the kill is asynchronous
        try:
            ray.get(node.address.remote(), timeout=5)
        except ray.exceptions.RayActorError:
            break
        assert time.monotonic() < deadline, "the actor did not die"
    assert poll() is None  # the actor is gone: out at once, however recent its last answer


def test_a_slow_tp_group_keeps_its_address_for_the_grace_and_a_dead_rank_relaunches_it_at_once(ray_cluster):
    """The same for a TP node (deploy/tp_group.py): ranks that answer late keep the group's
    address for the grace, then the group restarts; a dead rank restarts it at once."""
    import ray

    from deploy.tp_group import TPNodeGroup

    group = TPNodeGroup("decode", 0, "{}", 2, {})
    relaunched: list[str] = []
    group._relaunch = relaunched.append  # type: ignore[method-assign]  # records instead of restarting
    group.ranks = [ray.remote(SlowNode).options(num_cpus=0, max_concurrency=32).remote() for _ in range(2)]
    ray.get([r.set_delay.remote(0.0) for r in group.ranks], timeout=60)
    assert group.poll(0.3, grace_s=3.0) == "127.0.0.1:4242" and not relaunched
    ray.get(group.ranks[1].set_delay.remote(5.0))
    started = time.monotonic()
    assert group.poll(0.3, grace_s=3.0) == "127.0.0.1:4242" and not relaunched  # late, within the grace: kept
    while time.monotonic() - started < 3.1 and not relaunched:
        last = group.poll(0.3, grace_s=3.0)
    assert last is None and relaunched and "not answered" in relaunched[0]
    ray.get(group.ranks[1].set_delay.remote(0.0))
    relaunched.clear()
    assert group.poll(5.0, grace_s=3.0) == "127.0.0.1:4242"  # answers again
    ray.kill(group.ranks[0], no_restart=True)
    deadline = time.monotonic() + 30
    while not relaunched:  # the kill is asynchronous; no grace for a dead rank
        assert group.poll(5.0, grace_s=600.0) in (None, "127.0.0.1:4242")
        assert time.monotonic() < deadline, "the dead rank did not relaunch the group"
    assert "down" in relaunched[0]


def test_a_tp_group_that_has_just_joined_gets_the_grace_for_its_first_answer(ray_cluster):
    """Ranks that joined but answer their first address call late (a loaded host) are not
    relaunched before the grace: the group is alive, only not serving yet (None)."""
    import ray

    from deploy.tp_group import TPNodeGroup

    group = TPNodeGroup("decode", 0, "{}", 2, {})
    relaunched: list[str] = []
    group._relaunch = relaunched.append  # type: ignore[method-assign]
    group.ranks = [ray.remote(SlowNode).options(num_cpus=0, max_concurrency=32).remote() for _ in range(2)]
    group._joining = [r.set_delay.remote(5.0) for r in group.ranks]  # joined: their calls have returned
    ray.get(group._joining, timeout=60)
    assert group.poll(0.3, grace_s=3.0) is None and not relaunched  # late, within the grace
    started = time.monotonic()
    while time.monotonic() - started < 3.1 and not relaunched:
        group.poll(0.3, grace_s=3.0)
    assert relaunched and "not answered" in relaunched[0]
