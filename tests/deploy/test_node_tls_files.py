"""Node TLS configuration: `pdserve certs` writes a CA and a certificate that node TLS accepts;
`pdserve up`'s flags reach `cluster.node_tls_*`; the three files go together; and every unusable
file (missing, not PEM, a key of another certificate, a certificate of another CA, expired,
without the node name, server-auth only) is a clear error at start, before any actor."""

from __future__ import annotations

import datetime
import os

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from deploy.certs import write_dev_certs
from deploy.cli import build_parser, main
from deploy.cli_service import service_config
from deploy.config import ConfigError, ServiceConfig
from deploy.service import Service
from protos.tls import NodeTls, TlsError


def _cfg(ca, cert, key, **extra) -> ServiceConfig:
    return ServiceConfig.load(None, {"cluster.node_tls_ca": str(ca), "cluster.node_tls_cert": str(cert),
                                     "cluster.node_tls_key": str(key)} | extra)


def test_pdserve_certs_writes_files_node_tls_accepts_and_keeps_existing_ones(tmp_path, capsys):
    assert main(["certs", "--out", str(tmp_path), "--host", "router.example", "--host", "10.0.0.7"]) == 0
    assert "--node-tls-ca" in capsys.readouterr().out
    assert sorted(os.listdir(tmp_path)) == ["ca.crt", "ca.key", "tls.crt", "tls.key"]
    assert {f: os.stat(tmp_path / f).st_mode & 0o777 for f in ("ca.key", "tls.key")} == {"ca.key": 0o600,
                                                                                         "tls.key": 0o600}
    tls = NodeTls.load(str(tmp_path / "ca.crt"), str(tmp_path / "tls.crt"), str(tmp_path / "tls.key"))
    names = x509.load_pem_x509_certificate(tls.cert).extensions.get_extension_for_class(
        x509.SubjectAlternativeName).value
    assert "router.example" in names.get_values_for_type(x509.DNSName)
    before = (tmp_path / "tls.key").read_bytes()
    assert main(["certs", "--out", str(tmp_path)]) == 2
    assert "already exist" in capsys.readouterr().err and (tmp_path / "tls.key").read_bytes() == before
    assert main(["certs", "--out", str(tmp_path), "--force"]) == 0
    assert (tmp_path / "tls.key").read_bytes() != before
    assert main(["certs", "--out", str(tmp_path / "x"), "--days", "0"]) == 2


def test_up_flags_reach_the_cluster_section_and_the_files_go_together():
    args = build_parser().parse_args(["up", "--node-tls-ca", "ca.pem", "--node-tls-cert", "c.pem",
                                      "--node-tls-key", "k.pem"])
    c = service_config(args).cluster
    assert (c.node_tls_ca, c.node_tls_cert, c.node_tls_key, c.node_tls_name) == ("ca.pem", "c.pem", "k.pem",
                                                                                 "pdserve-node")
    assert c.node_tls and not ServiceConfig().cluster.node_tls
    with pytest.raises(ConfigError, match="node_tls_ca, node_tls_cert and node_tls_key go together"):
        ServiceConfig.load(None, {"cluster.node_tls_cert": "c.pem", "cluster.node_tls_key": "k.pem"})
    with pytest.raises(ConfigError, match="unknown config key 'cluster.node_tls_crt'"):
        ServiceConfig.load(None, {"cluster.node_tls_crt": "c.pem"})


@pytest.fixture(scope="module")
def two_sets(tmp_path_factory):
    root = tmp_path_factory.mktemp("sets")
    return write_dev_certs(root / "ours"), write_dev_certs(root / "theirs")


def _issue(ours: dict, path, not_after: datetime.timedelta, usages: list) -> str:
    """A certificate the CA of `ours` signs, for tls.key's key, with this validity and EKU."""
    ca_key = serialization.load_pem_private_key(ours["ca.key"].read_bytes(), None)
    ca = x509.load_pem_x509_certificate(ours["ca.crt"].read_bytes())
    key = serialization.load_pem_private_key(ours["tls.key"].read_bytes(), None)
    now = datetime.datetime.now(datetime.UTC)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey) and isinstance(key, ec.EllipticCurvePrivateKey)
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "n")]))
            .issuer_name(ca.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=2)).not_valid_after(now + not_after)
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("pdserve-node")]), critical=False)
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False).sign(ca_key, hashes.SHA256()))
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return str(path)


def _bad_files(ours: dict, theirs: dict, tmp_path) -> dict:
    (tmp_path / "junk.pem").write_text("not a certificate\n")
    (tmp_path / "broken.pem").write_text("-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n")
    both = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    return {  # (ca, cert, key, name): the error
        "cannot read the TLS node CA file .*nope.crt": (tmp_path / "nope.crt", ours["tls.crt"], ours["tls.key"], None),
        "node certificate file .*junk.pem is not PEM": (ours["ca.crt"], tmp_path / "junk.pem", ours["tls.key"], None),
        "broken.pem holds no valid certificate": (ours["ca.crt"], tmp_path / "broken.pem", ours["tls.key"], None),
        "node key .*tls.key does not match the node certificate": (ours["ca.crt"], ours["tls.crt"], theirs["tls.key"],
                                                                   None),
        "is not signed by the cluster CA": (theirs["ca.crt"], ours["tls.crt"], ours["tls.key"], None),
        "does not name 'node-b' in its subjectAltName": (ours["ca.crt"], ours["tls.crt"], ours["tls.key"], "node-b"),
        "expired.pem is valid only from": (ours["ca.crt"], _issue(ours, tmp_path / "expired.pem",
                                                                  -datetime.timedelta(days=1), both), ours["tls.key"],
                                           None),
        "must allow both server and client auth": (ours["ca.crt"], _issue(
            ours, tmp_path / "server.pem", datetime.timedelta(days=1), both[:1]), ours["tls.key"], None),
    }


def test_unusable_node_tls_files_are_clear_errors_at_start(two_sets, tmp_path):
    ours, theirs = two_sets
    Service(_cfg(ours["ca.crt"], ours["tls.crt"], ours["tls.key"]))  # the good set passes
    for message, (ca, cert, key, name) in _bad_files(ours, theirs, tmp_path).items():
        extra = {"cluster.node_tls_name": name} if name else {}
        with pytest.raises(TlsError, match=message):
            Service(_cfg(ca, cert, key, **extra))  # checked in __init__, before Ray is touched


def test_a_bad_node_tls_file_is_one_error_line_from_pdserve_up(two_sets, capsys):
    ours, _ = two_sets
    assert main(["up", "--node-tls-ca", str(ours["ca.crt"]), "--node-tls-cert", str(ours["ca.key"]),
                 "--node-tls-key", str(ours["tls.key"])]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: the TLS node certificate file") and err.count("\n") == 1
