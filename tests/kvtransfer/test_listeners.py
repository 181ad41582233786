"""KV listeners of a local service bind loopback only: the tcp receiver its host, and UCX
(restricted before it starts, in a fresh process: UCX reads it once per process) no outward
address."""

from __future__ import annotations

import json
import subprocess
import sys

from kvtransfer.tcp import TcpReceiver
from tests.listening import listening

UCX_CHILD = """
import json, sys
from kvtransfer.ucx import UcxReceiver, UcxSender, restrict_to_loopback
from tests.listening import listening
restricted = restrict_to_loopback(sys.argv[1])
r, s = UcxReceiver(timeout_s=5), UcxSender(timeout_s=5)
print(json.dumps({"restricted": restricted, "listening": listening()}))
r.close(); s.close()
"""


def ucx_listening(host: str) -> dict:
    env = {k: v for k, v in __import__("os").environ.items() if k != "UCX_NET_DEVICES"}
    out = subprocess.run([sys.executable, "-c", UCX_CHILD, host], capture_output=True, text=True,
                         timeout=120, env=env, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_ucx_of_a_local_service_listens_on_loopback_only():
    got = ucx_listening("127.0.0.1")
    assert got["restricted"] and got["listening"], got  # UCX's tcp transport does listen
    assert all(ip == "127.0.0.1" for ip, _port in got["listening"]), got
    assert not ucx_listening("0.0.0.0")["restricted"]  # every interface: UCX's own default


def test_tcp_receiver_listens_on_its_host_only():
    r = TcpReceiver(host="127.0.0.1", timeout_s=5)
    try:
        assert [(ip, port) for ip, port in listening() if port == r.port] == [("127.0.0.1", r.port)]
    finally:
        r.close()
