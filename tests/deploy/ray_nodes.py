"""A Ray cluster of several raylets on this machine, for multi-node tests: a head and worker
nodes started with `ray start` (each its own process group, on loopback 127.0.0.2, offering custom
resources such as `pdserve_decode`), standing in for separate hosts. A node is killed whole
(raylet and every process it started) with SIGKILL to its process group; nothing else on the
machine is touched (never `ray stop`). Every wait is bounded."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

RAY = str(Path(sys.executable).parent / "ray")
# Loopback-only test clusters, with no token auth (Ray 2.5x+ `ray start` turns it on, and a
# driver then needs RAY_AUTH_MODE=token and the token). `ray start` joins a second raylet only
# with RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1, and with it swaps 127.0.0.1 for the host's outward
# address; 127.0.0.2 (loopback too) is kept as given. Drivers join with _node_ip_address=NODE_IP.
NODE_IP = "127.0.0.2"
ENV = os.environ | {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
START_ENV = ENV | {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1"}
# GCS notices a dead raylet after health_check_period x threshold (default 3 s x 5).
PORT_FLAGS = ("node-manager-port", "object-manager-port", "metrics-export-port", "dashboard-agent-listen-port",
              "dashboard-agent-grpc-port", "runtime-env-agent-port")
SYSTEM_CONFIG = {"health_check_period_ms": 1000, "health_check_failure_threshold": 5}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RayNodes:
    def __init__(self, temp_dir: str) -> None:
        self.temp_dir = temp_dir
        self.port = free_port()
        self.address = f"{NODE_IP}:{self.port}"
        self.procs: dict[str, subprocess.Popen] = {}
        self.starts: dict[str, tuple[list[str], dict[str, float]]] = {}
        self.retries: dict[str, int] = {}

    def start_head(self, resources: dict[str, float], timeout: float = 120.0) -> None:
        self._start("head", ["--head", f"--port={self.port}", f"--temp-dir={self.temp_dir}",
                             "--include-dashboard=true", "--dashboard-host=127.0.0.1",
                             f"--dashboard-port={free_port()}", f"--system-config={json.dumps(SYSTEM_CONFIG)}"],
                    resources)
        deadline = time.monotonic() + timeout
        while not _listening(self.port):
            self._check_alive("head")
            assert time.monotonic() < deadline, "the Ray head did not start"
            time.sleep(0.2)

    def connect(self, namespace: str) -> None:
        """Join as this process's Ray driver."""
        import ray

        ray.init(address=self.address, _node_ip_address=NODE_IP, namespace=namespace,
                 log_to_driver=False, configure_logging=False)

    def add_node(self, name: str, resources: dict[str, float]) -> None:
        """Start a worker raylet; the caller waits for it (wait_for_node) through its driver."""
        self._start(name, [f"--address={self.address}"], resources)

    def _start(self, name: str, args: list[str], resources: dict[str, float]) -> None:
        self.starts[name] = (args, resources)
        ports = [f"--{p}={free_port()}" for p in PORT_FLAGS]  # raylets on one IP: never the same port
        cmd = [RAY, "start", "--block", f"--node-ip-address={NODE_IP}", "--num-cpus=1", "--num-gpus=0",
               f"--resources={json.dumps(resources)}", "--disable-usage-stats", *ports, *args]
        log = open(Path(self.temp_dir) / f"{name}.out", "ab")  # noqa: SIM115 (closed with the process)
        self.procs[name] = subprocess.Popen(cmd, env=START_ENV, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True)

    def kill(self, name: str, timeout: float = 30.0) -> None:
        """SIGKILL the node's whole process group (its raylet and the workers it started)."""
        proc = self.procs.pop(name)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=timeout)
        deadline = time.monotonic() + timeout
        while _group_alive(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)

    def shutdown(self) -> None:
        for name in [n for n in self.procs if n != "head"] + (["head"] if "head" in self.procs else []):
            self.kill(name)

    def wait_for(self, name: str, resource: str, timeout: float = 120.0) -> None:
        """Wait (from a connected driver) until node `name` has joined, offering `resource`."""
        import ray

        deadline = time.monotonic() + timeout
        while not any(n["Alive"] and resource in n["Resources"] for n in ray.nodes()):
            if self._startup_timed_out(name) and self.retries.get(name, 0) < 2:
                self.retries[name] = self.retries.get(name, 0) + 1
                self.kill(name)  # whatever the failed start left in its group
                self._start(name, *self.starts[name])  # a loaded machine: try again, same deadline
            self._check_alive(name)
            assert time.monotonic() < deadline, f"{name} did not join with {resource}: {ray.nodes()}"
            time.sleep(0.2)

    def _startup_timed_out(self, name: str) -> bool:
        """`ray start` gives up on a worker raylet whose GCS registration took over its fixed 30 s
        (seen on a 2-core CI machine under load); that is worth a retry, any other exit is not."""
        proc = self.procs[name]
        if proc.poll() is None or name == "head":
            return False
        log = (Path(self.temp_dir) / f"{name}.out").read_text(errors="replace")
        return log.count("timed out during startup") > self.retries.get(name, 0)

    def _check_alive(self, name: str) -> None:
        proc = self.procs[name]
        if proc.poll() is not None:
            log = (Path(self.temp_dir) / f"{name}.out").read_text(errors="replace")[-3000:]
            raise RuntimeError(f"`ray start` for {name} exited ({proc.returncode}):\n{log}")


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex((NODE_IP, port)) == 0


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False
