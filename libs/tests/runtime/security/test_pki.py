"""The local CA (issue 18): keys readable by their owner only, leaves a TLS client accepts,
and reuse until a certificate nears its end."""

from __future__ import annotations

import datetime as dt
import ipaddress
import ssl
import stat
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID

from inferplane.runtime.security.pki import LocalCA

NOW = dt.datetime(2026, 11, 25, 12, 0, tzinfo=dt.UTC)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def load(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def test_ca_and_leaf_files_keys_0600(tmp_path: Path) -> None:
    """Invariant: private keys are readable by their owner only; the CA folder is 0700."""
    ca = LocalCA.ensure(tmp_path / "pki")
    leaf = ca.issue("edge", dns_names=("localhost",), ip_addresses=("127.0.0.1",))
    assert mode(ca.directory) == 0o700
    assert mode(ca.key_path) == 0o600 and mode(leaf.key_path) == 0o600
    assert mode(ca.cert_path) == 0o644 and mode(leaf.cert_path) == 0o644


def test_leaf_is_p256_with_sans_both_ekus_and_the_asked_validity(tmp_path: Path) -> None:
    ca = LocalCA.ensure(tmp_path, now=NOW)
    leaf = ca.issue(
        "edge", dns_names=("localhost",), ip_addresses=("127.0.0.1", "::1"), days=7, now=NOW
    )
    cert = load(leaf.cert_path)
    cert.verify_directly_issued_by(load(ca.cert_path))
    key = cert.public_key()
    assert isinstance(key, ec.EllipticCurvePublicKey) and key.curve.name == "secp256r1"
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == ["localhost"]
    assert sans.get_values_for_type(x509.IPAddress) == [
        ipaddress.ip_address("127.0.0.1"),
        ipaddress.ip_address("::1"),
    ]
    ekus = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert set(ekus) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    assert cert.not_valid_after_utc == NOW + dt.timedelta(days=7) == leaf.not_after
    assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca


def test_python_ssl_accepts_the_chain(tmp_path: Path) -> None:
    """What clients notice: a default TLS context trusting ca.crt loads the leaf's chain."""
    ca = LocalCA.ensure(tmp_path)
    leaf = ca.issue("edge", dns_names=("localhost",))
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(leaf.cert_path, leaf.key_path)  # key matches the certificate
    client = ssl.create_default_context(cafile=str(ca.cert_path))
    assert client.get_ca_certs()[0]["subject"] == ((("commonName", "inferplane local CA"),),)


def test_an_existing_ca_and_a_fresh_leaf_are_reused(tmp_path: Path) -> None:
    ca = LocalCA.ensure(tmp_path, now=NOW)
    first = ca.issue("edge", dns_names=("localhost",), days=30, now=NOW)
    ca_bytes, leaf_bytes = ca.cert_path.read_bytes(), first.cert_path.read_bytes()
    later = NOW + dt.timedelta(days=15)
    again = LocalCA.ensure(tmp_path, now=later)
    second = again.issue("edge", dns_names=("localhost",), days=30, now=later)
    assert ca.cert_path.read_bytes() == ca_bytes
    assert second.cert_path.read_bytes() == leaf_bytes


def test_a_leaf_close_to_expiry_is_reissued(tmp_path: Path) -> None:
    """Invariant: a leaf with a third or less of its validity left is replaced (new key)."""
    ca = LocalCA.ensure(tmp_path, now=NOW)
    first = ca.issue("edge", dns_names=("localhost",), days=30, now=NOW)
    old_key = first.key_path.read_bytes()
    later = NOW + dt.timedelta(days=21)
    second = ca.issue("edge", dns_names=("localhost",), days=30, now=later)
    assert second.not_after == later + dt.timedelta(days=30)
    assert second.key_path.read_bytes() != old_key


def test_changed_sans_or_a_new_ca_reissue_the_leaf(tmp_path: Path) -> None:
    ca = LocalCA.ensure(tmp_path, now=NOW)
    first = ca.issue("edge", dns_names=("localhost",), now=NOW).cert_path.read_bytes()
    other = ca.issue("edge", dns_names=("localhost", "edge.local"), now=NOW)
    assert other.cert_path.read_bytes() != first
    before = other.cert_path.read_bytes()
    # A CA near its end is replaced, and the leaves it signed with it.
    ca_later = NOW + dt.timedelta(days=3650 - 10)
    renewed = LocalCA.ensure(tmp_path, now=ca_later)
    leaf = renewed.issue("edge", dns_names=("localhost", "edge.local"), now=ca_later)
    assert leaf.cert_path.read_bytes() != before
    load(leaf.cert_path).verify_directly_issued_by(load(renewed.cert_path))


@pytest.mark.parametrize(
    ("name", "kwargs"),
    [
        ("edge", {}),
        ("edge", {"dns_names": ("localhost",), "days": 0}),
        ("../x", {"dns_names": ("localhost",)}),
        ("ca", {"dns_names": ("localhost",)}),
        ("edge", {"ip_addresses": ("not-an-ip",)}),
    ],
)
def test_bad_requests_are_refused(tmp_path: Path, name: str, kwargs: dict) -> None:
    with pytest.raises(ValueError):
        LocalCA.ensure(tmp_path).issue(name, **kwargs)
