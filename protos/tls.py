"""TLS on pdserve's gRPC channels: reading PEM files (shared with the client API's router/tls.py)
and mutual TLS on the node control channels (router -> node, prefill node -> decode node).

Node mTLS: every node's server presents the node certificate and requires a client certificate
signed by the cluster CA; the router and prefill nodes present theirs (one certificate may serve
every process). Nodes are reached by IP (pod IPs change), so clients check a node's certificate
against a fixed name, `NodeTls.name` (default `pdserve-node`, a subjectAltName DNS entry), not
against its address. The cluster secret (protos/serving.py) stays as a second check.

`NodeTls.load` reads the three files and refuses, with a `TlsError` naming the file, one that is
missing, not PEM, a key that does not match the certificate, a certificate the CA did not sign,
out of its validity period, without the name, or not usable for both server and client auth:
errors a TLS handshake would only report as UNAVAILABLE.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

NODE_TLS_NAME = "pdserve-node"


class TlsError(ValueError):
    """A certificate, key or CA file that cannot be used."""


def read_pem(path: str, what: str) -> bytes:
    """The bytes of a PEM file (`~` expanded); TlsError when it cannot be read or holds no PEM block."""
    try:
        data = Path(path).expanduser().read_bytes()
    except OSError as e:
        raise TlsError(f"cannot read the TLS {what} file {path}: {e.strerror or e}") from None
    if b"-----BEGIN " not in data:
        raise TlsError(f"the TLS {what} file {path} is not PEM (no -----BEGIN line)")
    return data


@dataclass(frozen=True, repr=False)  # repr=False: the key is never printed
class NodeTls:
    """The cluster CA, this process's certificate chain and key (PEM bytes), and the name node
    certificates carry."""

    ca: bytes
    cert: bytes
    key: bytes
    name: str = NODE_TLS_NAME

    @classmethod
    def load(cls, ca: str, cert: str, key: str, name: str = NODE_TLS_NAME) -> NodeTls:
        """Read and check the files (see the module docstring); TlsError when one is unusable."""
        tls = cls(read_pem(ca, "node CA"), read_pem(cert, "node certificate"), read_pem(key, "node key"), name)
        check_node_files(tls, ca, cert, key)
        return tls

    def server_credentials(self) -> grpc.ServerCredentials:
        """A node server's: presents the node certificate, requires a client one the CA signed."""
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca,
                                           require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """A node client's: trusts only the cluster CA, presents the node certificate."""
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                            certificate_chain=self.cert)

    def channel_options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.name)]


def node_channel(address: str, tls: NodeTls | None, options: list[tuple[str, Any]]) -> grpc.Channel:
    """A (blocking) channel to a node: mutual TLS with `tls`, else plain text."""
    if tls is None:
        return grpc.insecure_channel(address, options=options)
    return grpc.secure_channel(address, tls.channel_credentials(), options=options + tls.channel_options())


def node_aio_channel(address: str, tls: NodeTls | None, options: list[tuple[str, Any]]) -> grpc.aio.Channel:
    """As `node_channel`, for asyncio (the router)."""
    if tls is None:
        return grpc.aio.insecure_channel(address, options=options)
    return grpc.aio.secure_channel(address, tls.channel_credentials(), options=options + tls.channel_options())


def check_node_files(tls: NodeTls, ca_path: str, cert_path: str, key_path: str) -> None:
    """TlsError unless the key matches the certificate and the certificate is one a node can use."""
    from cryptography import x509

    cas = _certificates(tls.ca, ca_path, "node CA")
    chain = _certificates(tls.cert, cert_path, "node certificate")
    leaf = chain[0]
    if _public_der(_private_key(tls.key, key_path).public_key()) != _public_der(leaf.public_key()):
        raise TlsError(f"the node key {key_path} does not match the node certificate {cert_path}")
    if not any(_signed_by(chain[-1], ca) for ca in cas):
        raise TlsError(f"the node certificate {cert_path} is not signed by the cluster CA {ca_path}")
    now = datetime.datetime.now(datetime.UTC)
    if not leaf.not_valid_before_utc <= now <= leaf.not_valid_after_utc:
        raise TlsError(f"the node certificate {cert_path} is valid only from {leaf.not_valid_before_utc} "
                       f"to {leaf.not_valid_after_utc}")
    names = _extension(leaf, x509.SubjectAlternativeName)
    if names is None or tls.name not in names.get_values_for_type(x509.DNSName):
        raise TlsError(f"the node certificate {cert_path} does not name {tls.name!r} in its subjectAltName "
                       "(DNS): clients check every node's certificate against that name (cluster.node_tls_name)")
    _check_usage(leaf, cert_path)


def _check_usage(leaf: Any, cert_path: str) -> None:
    from cryptography import x509
    from cryptography.x509.oid import ExtendedKeyUsageOID

    usage = _extension(leaf, x509.ExtendedKeyUsage)
    wanted = {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    if usage is not None and not wanted <= set(usage):
        raise TlsError(f"the node certificate {cert_path} must allow both server and client auth "
                       "(extendedKeyUsage): nodes serve with it and the router and prefill nodes call with it")


def _certificates(pem: bytes, path: str, what: str) -> list[Any]:
    from cryptography import x509

    try:
        return x509.load_pem_x509_certificates(pem)
    except ValueError as e:
        raise TlsError(f"the TLS {what} file {path} holds no valid certificate: {e}") from None


def _private_key(pem: bytes, path: str) -> Any:
    from cryptography.hazmat.primitives.serialization import load_pem_private_key

    try:
        return load_pem_private_key(pem, password=None)
    except (ValueError, TypeError) as e:  # TypeError: encrypted with a passphrase
        raise TlsError(f"the TLS node key file {path} holds no usable private key "
                       f"(PEM, not encrypted): {e}") from None


def _public_der(public_key: Any) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return public_key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


def _signed_by(cert: Any, ca: Any) -> bool:
    from cryptography.exceptions import InvalidSignature

    if cert == ca:
        return True
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):  # another issuer, key type or signature
        return False
    return True


def _extension(cert: Any, kind: type) -> Any:
    from cryptography import x509

    try:
        return cert.extensions.get_extension_for_class(kind).value
    except x509.ExtensionNotFound:
        return None
