"""TLS for the client API: the router's gRPC and HTTP ports (`--tls-cert` / `--tls-key`), and the
clients' side (`--tls-ca`).

Receives PEM file paths (a certificate chain and its private key on the server; a CA bundle on
the client); hands on gRPC credentials. A file that is missing, unreadable or not PEM is a
`TlsError` (a ValueError: the CLI prints one `error:` line) naming the file, raised before any
port is bound. The HTTP door gets the same files through uvicorn (`ssl_certfile`/`ssl_keyfile`).
Node control channels have their own mutual TLS: protos/tls.py.
"""

from __future__ import annotations

import grpc

from protos.tls import TlsError, read_pem

__all__ = ["TlsError", "channel_credentials", "read_pem", "server_credentials"]


def server_credentials(cert: str, key: str) -> grpc.ServerCredentials:
    """gRPC server credentials from a certificate chain and its private key."""
    chain = read_pem(cert, "certificate")
    return grpc.ssl_server_credentials([(read_pem(key, "key"), chain)])


def channel_credentials(ca: str | None) -> grpc.ChannelCredentials:
    """Client credentials trusting `ca` (PEM bundle); None: the system's roots."""
    return grpc.ssl_channel_credentials(root_certificates=read_pem(ca, "CA") if ca else None)
