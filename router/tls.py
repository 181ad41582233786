"""TLS for the client API: the router's gRPC and HTTP ports (`--tls-cert` / `--tls-key`), and the
clients' side (`--tls-ca`).

Receives PEM file paths (a certificate chain and its private key on the server; a CA bundle on
the client); hands on gRPC credentials. A file that is missing, unreadable or not PEM is a
`TlsError` (a ValueError: the CLI prints one `error:` line) naming the file, raised before any
port is bound. The HTTP door gets the same files through uvicorn (`ssl_certfile`/`ssl_keyfile`).
"""

from __future__ import annotations

from pathlib import Path

import grpc


class TlsError(ValueError):
    """A certificate, key or CA file that cannot be used."""


def read_pem(path: str, what: str) -> bytes:
    """The bytes of a PEM file; TlsError when it cannot be read or holds no PEM block."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise TlsError(f"cannot read the TLS {what} file {path}: {e.strerror or e}") from None
    if b"-----BEGIN " not in data:
        raise TlsError(f"the TLS {what} file {path} is not PEM (no -----BEGIN line)")
    return data


def server_credentials(cert: str, key: str) -> grpc.ServerCredentials:
    """gRPC server credentials from a certificate chain and its private key."""
    chain = read_pem(cert, "certificate")
    return grpc.ssl_server_credentials([(read_pem(key, "key"), chain)])


def channel_credentials(ca: str | None) -> grpc.ChannelCredentials:
    """Client credentials trusting `ca` (PEM bundle); None: the system's roots."""
    return grpc.ssl_channel_credentials(root_certificates=read_pem(ca, "CA") if ca else None)
