"""Starting the nodes' gRPC servers (threaded; the node loops do the real work)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent import futures
from typing import Any

import grpc

from protos.messages import MAX_MESSAGE_BYTES

GRPC_OPTIONS = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]


def start_server(register: Callable[[Any, grpc.Server], None], servicer: Any, host: str, port: int,
                 workers: int) -> tuple[grpc.Server, int]:
    """`register` is the generated `add_*Servicer_to_server`; returns the server and its port."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers), options=GRPC_OPTIONS)
    register(servicer, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    server.start()
    return server, bound
