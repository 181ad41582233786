"""`pdserve up`'s start, without Ray: what runs beside Ray's start, and the line that says where the time went."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from deploy.actors import NodeActor
from deploy.cli_service import probe_device, start_service, startup_line
from deploy.config import ServiceConfig
from deploy.procmem import gc_paused
from deploy.service import init_ray

ROOT = Path(__file__).resolve().parents[2]
ROUTER_PROBE = """
import asyncio, sys
from deploy.config import ServiceConfig
from deploy.router_actor import RouterActor

async def serve_once():
    cfg = ServiceConfig.load(None, {"router.host": "127.0.0.1", "router.port": 0, "router.http_port": 0})
    router = RouterActor(cfg.model_dump_json())
    print(await router.start())
    await router.stop()

asyncio.run(serve_once())
print(sorted({m.split(".")[0] for m in sys.modules} & {"torch", "triton"}))
"""


def _model(device: str, resolve) -> SimpleNamespace:
    return SimpleNamespace(model=SimpleNamespace(device=device, resolved_device=resolve))


def test_auto_device_is_probed_in_a_thread():
    asked = []
    thread = probe_device(_model("auto", lambda: asked.append(threading.current_thread().name)))
    assert thread is not None
    thread.join(timeout=10)
    assert asked == ["device-probe"]


def test_a_named_device_needs_no_probe():
    assert probe_device(_model("cuda", lambda: pytest.fail("probed"))) is None


def test_a_failed_probe_is_left_to_the_service():
    def fail():
        raise RuntimeError("torch is broken")

    errors = []
    hook, threading.excepthook = threading.excepthook, lambda args: errors.append(args.exc_value)
    try:
        thread = probe_device(_model("auto", fail))
        assert thread is not None
        thread.join(timeout=10)
    finally:
        threading.excepthook = hook
    assert errors == []


class _Service:
    def __init__(self, startup: dict[str, float]) -> None:
        self.startup = startup

    def node_info(self):
        return {("decode", 0): {"startup": {"imports": 2.0, "model_load": 1.0}}}


def test_ready_counts_the_whole_start():
    line = startup_line(_Service({"ray_init": 3.0, "router_serving": 1.0, "nodes_serving": 5.0, "total": 9.5}))
    assert line.startswith("ready in 9.5 s: Ray 3.0 s, router serving at 1.0 s, nodes at 5.0 s; slowest node "
                           "decode-0: imports 2.0 s, model_load 1.0 s"), line


def test_ready_without_a_total_adds_ray_and_nodes():
    line = startup_line(_Service({"ray_init": 3.0, "nodes_serving": 5.0}))
    assert line.startswith("ready in 8.0 s:"), line


class _Loaded(Exception):
    pass


def test_a_node_makes_its_cuda_context_before_it_loads_the_model(monkeypatch):
    """The node's device goes to the early CUDA context, before the model loads on it."""
    calls = []
    monkeypatch.setattr("deploy.actors.node_logging", lambda: None)
    monkeypatch.setattr("torch.set_num_threads", lambda n: None)
    monkeypatch.setattr("engine.cuda_init.start_cuda_init", lambda device: calls.append(("context", device)))
    monkeypatch.setattr("gc.freeze", lambda: None)  # not this test process's heap

    def load_model(name, device, **kw):
        calls.append(("load", device))
        raise _Loaded

    monkeypatch.setattr("engine.model.loader.load_model", load_model)
    cfg = ServiceConfig.load(None, {"model.name": "tiny", "model.device": "cuda:3"})
    with pytest.raises(_Loaded):
        NodeActor("decode", "decode-0", cfg.model_dump_json())
    assert calls == [("context", "cuda:3"), ("load", "cuda:3")]


def test_the_router_starts_without_torch():
    """The router process serves its default model (resolved by name, read by engine/model/info.py)
    without importing torch or triton: a node's imports, not the router's, are on the way to ready."""
    out = subprocess.run([sys.executable, "-c", ROUTER_PROBE], capture_output=True, text=True, check=True, cwd=ROOT,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, timeout=120).stdout.splitlines()
    assert out[0].startswith("127.0.0.1:"), out
    assert out[-1] == "[]"


@pytest.mark.parametrize(("overrides", "cpus"), [({}, 4), ({"colocated.num_nodes": 3, "colocated.num_cpus": 0.5}, 4),
                                                 ({"decode.num_nodes": 4}, 7)])
def test_a_local_cluster_has_the_cpus_its_nodes_take_not_the_hosts(monkeypatch, overrides, cpus):
    """Ray starts a worker process per logical CPU as the driver connects: a local cluster as large as
    a many-core host would start dozens beside the nodes."""
    for name in ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_gcs_server_port_wait_time_s"):
        monkeypatch.setenv(name, "0" if "WINDOWS" in name else "120")
    seen: dict = {}
    monkeypatch.setattr("os.cpu_count", lambda: 192)
    monkeypatch.setattr("ray.is_initialized", lambda: False)
    monkeypatch.setattr("ray.init", lambda **kw: seen.update(kw))
    init_ray(ServiceConfig.load(None, overrides))
    assert seen["address"] == "local" and seen["num_cpus"] == cpus


def test_a_node_freezes_its_imported_modules_before_it_loads_the_model(monkeypatch):
    """The modules' objects are frozen once imported, so the collection before serving walks only the node's."""
    calls = []
    monkeypatch.setattr("deploy.actors.node_logging", lambda: None)
    monkeypatch.setattr("torch.set_num_threads", lambda n: None)
    monkeypatch.setattr("gc.freeze", lambda: calls.append("freeze"))

    def load_model(name, device, **kw):
        calls.append("load")
        raise _Loaded

    monkeypatch.setattr("engine.model.loader.load_model", load_model)
    cfg = ServiceConfig.load(None, {"model.name": "tiny", "model.device": "cpu"})
    with pytest.raises(_Loaded):
        NodeActor("decode", "decode-0", cfg.model_dump_json())
    assert calls == ["freeze", "load"]


def test_a_node_imports_with_the_garbage_collector_off(monkeypatch):
    """No full collections through the node's imports; the collector is back on (the modules frozen)
    before the model loads, and after a start that failed."""
    import gc

    calls = []
    monkeypatch.setattr("deploy.actors.node_logging", lambda: None)
    monkeypatch.setattr("torch.set_num_threads", lambda n: None)
    monkeypatch.setattr("engine.cuda_init.start_cuda_init", lambda device: calls.append(("imports", gc.isenabled())))
    monkeypatch.setattr("gc.freeze", lambda: calls.append(("freeze", gc.isenabled())))

    def load_model(name, device, **kw):
        calls.append(("load", gc.isenabled()))
        raise _Loaded

    monkeypatch.setattr("engine.model.loader.load_model", load_model)
    cfg = ServiceConfig.load(None, {"model.name": "tiny", "model.device": "cpu"})
    assert gc.isenabled()
    with pytest.raises(_Loaded):
        NodeActor("decode", "decode-0", cfg.model_dump_json())
    assert calls == [("imports", False), ("freeze", False), ("load", True)] and gc.isenabled()


def test_ray_starts_with_the_garbage_collector_off(monkeypatch):
    import gc

    seen = []
    monkeypatch.setattr("deploy.service.init_ray", lambda cfg, temp_dir=None: seen.append(gc.isenabled()))
    monkeypatch.setattr("deploy.service.Service", lambda cfg: (_ for _ in ()).throw(_Loaded()))
    cfg = ServiceConfig.load(None, {"model.name": "tiny", "model.device": "cpu", "cluster.address": "auto"})
    with pytest.raises(_Loaded):
        start_service(cfg)
    assert seen == [False] and gc.isenabled()


def test_gc_paused_restores_the_collectors_state():
    import gc

    with pytest.raises(_Loaded), gc_paused():
        assert not gc.isenabled()
        raise _Loaded
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()  # off before: off after
    finally:
        gc.enable()
