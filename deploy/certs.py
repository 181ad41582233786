"""`pdserve certs --out DIR`: a development CA and one certificate it signs, for node mutual TLS
(`--node-tls-ca DIR/ca.crt --node-tls-cert DIR/tls.crt --node-tls-key DIR/tls.key`) and, with
`--host`, for the router's client port too (`--tls-cert DIR/tls.crt --tls-key DIR/tls.key`;
clients `--tls-ca DIR/ca.crt`).

Writes ca.crt, ca.key, tls.crt and tls.key (the names of a Kubernetes TLS Secret plus its CA);
keys are readable by their owner only, and existing files are kept unless `--force`. The
certificate names `pdserve-node` (what node clients check), localhost and 127.0.0.1, plus every
`--host`, and allows both server and client auth. For production, issue your own (cert-manager)
with the same shape.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from protos.tls import NODE_TLS_NAME

FILES = ("ca.crt", "ca.key", "tls.crt", "tls.key")


def make_ca(name: str = "pdserve-dev-ca", days: int = 365) -> tuple[Any, x509.Certificate]:
    """A new CA: its private key and self-signed certificate."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = _name(name)
    cert = (_builder(subject, subject, key.public_key(), days)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                         crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    return key, cert


def issue(ca_key: Any, ca_cert: x509.Certificate, hosts: list[str], days: int = 365) -> tuple[Any, x509.Certificate]:
    """A key and a certificate signed by the CA for server and client auth, naming `hosts` (DNS
    names or IP addresses; the first is the subject's common name)."""
    key = ec.generate_private_key(ec.SECP256R1())
    san = x509.SubjectAlternativeName([_general_name(h) for h in hosts])
    usage = x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH])
    cert = (_builder(_name(hosts[0]), ca_cert.subject, key.public_key(), days)
            .add_extension(san, critical=False).add_extension(usage, critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .sign(ca_key, hashes.SHA256()))
    return key, cert


def write_dev_certs(out: Path, hosts: list[str] | None = None, days: int = 365, force: bool = False) -> dict[str, Path]:
    """Write FILES into `out` (made if missing); returns their paths by name. ValueError when
    one exists (unless `force`) or `days` < 1."""
    if days < 1:
        raise ValueError(f"--days must be at least 1, got {days}")
    if any(not h.strip() for h in hosts or []):
        raise ValueError("--host must not be empty")
    paths = {name: out / name for name in FILES}
    existing = [str(p) for p in paths.values() if p.exists()]
    if existing and not force:
        raise ValueError(f"{', '.join(existing)} already exist(s); pass --force to replace them")
    ca_key, ca_cert = make_ca(days=days)
    names = list(dict.fromkeys([NODE_TLS_NAME, "localhost", "127.0.0.1", *(hosts or [])]))
    key, cert = issue(ca_key, ca_cert, names, days)
    out.mkdir(parents=True, exist_ok=True)
    _write(paths["ca.crt"], ca_cert.public_bytes(serialization.Encoding.PEM), 0o644)
    _write(paths["ca.key"], _key_pem(ca_key), 0o600)
    _write(paths["tls.crt"], cert.public_bytes(serialization.Encoding.PEM), 0o644)
    _write(paths["tls.key"], _key_pem(key), 0o600)
    return paths


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, metavar="DIR", help="directory to write ca.crt, ca.key, tls.crt, tls.key")
    p.add_argument("--host", action="append", default=[], metavar="NAME_OR_IP",
                   help="another name the certificate holds (e.g. the router's address for --tls-cert)")
    p.add_argument("--days", type=int, default=365, help="validity (default 365)")
    p.add_argument("--force", action="store_true", help="replace files that exist")


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    write_dev_certs(out, args.host, args.days, args.force)
    print(f"wrote {', '.join(str(out / f) for f in FILES)}\n"
          f"node mutual TLS: pdserve up --node-tls-ca {out / 'ca.crt'} --node-tls-cert {out / 'tls.crt'} "
          f"--node-tls-key {out / 'tls.key'}\n"
          f"Kubernetes: kubectl create secret generic pdserve-node-tls --from-file={out / 'ca.crt'} "
          f"--from-file={out / 'tls.crt'} --from-file={out / 'tls.key'}")
    return 0


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _builder(subject: x509.Name, issuer: x509.Name, public_key: Any, days: int) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(public_key)
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days)))


def _general_name(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def _key_pem(key: Any) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _write(path: Path, data: bytes, mode: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    os.fchmod(fd, mode)  # an existing file (--force) would keep its old mode
    with os.fdopen(fd, "wb") as f:
        f.write(data)
