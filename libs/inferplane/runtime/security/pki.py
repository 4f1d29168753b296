"""A local certificate authority: one CA per data directory, short-lived leaf certificates
issued from it per service (issue 18: edge TLS now, mTLS between the services next).

    ca = LocalCA.ensure(data_dir / "pki")                    # created once, then reused
    edge = ca.issue("edge", dns_names=("localhost",), ip_addresses=("127.0.0.1",), days=30)
    edge.cert_path, edge.key_path, ca.cert_path              # PEM files

Keys are ECDSA P-256, written 0600 (`private_files`); certificates are public (0644). A leaf
carries both the serverAuth and clientAuth extended key usages, so the same certificate can
serve a service's port and identify it as a client of another service. Both calls are
idempotent: a CA that is still valid for `min_ca_days_left` is reused, and a leaf is re-issued
only when it is missing, expires within a third of its validity, names other SANs, or was not
signed by the current CA.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import ipaddress
from collections.abc import Sequence
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from inferplane.runtime.security.private_files import write_private_file

CA_NAME = "inferplane local CA"
#: A clock skew allowance: certificates are valid from this long before they were made.
_BACKDATE = dt.timedelta(minutes=5)


def _utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _key_pem(key: ec.EllipticCurvePrivateKey) -> str:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    ).decode()


def _write_cert(path: Path, cert: x509.Certificate) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    tmp.chmod(0o644)
    tmp.replace(path)  # atomic: a reader never sees half a certificate


def _load_cert(path: Path) -> x509.Certificate | None:
    try:
        return x509.load_pem_x509_certificate(path.read_bytes())
    except (OSError, ValueError):
        return None


def _sans(dns_names: Sequence[str], ip_addresses: Sequence[str]) -> list[x509.GeneralName]:
    names: list[x509.GeneralName] = [x509.DNSName(n) for n in dns_names]
    names += [x509.IPAddress(ipaddress.ip_address(a)) for a in ip_addresses]
    return names


@dataclasses.dataclass(frozen=True, slots=True)
class IssuedCertificate:
    """A leaf certificate and its key, both PEM files; `not_after` is UTC."""

    name: str
    cert_path: Path
    key_path: Path
    not_after: dt.datetime


@dataclasses.dataclass(frozen=True, slots=True)
class LocalCA:
    """The CA in `directory`: `ca.crt` (public, what clients trust) and `ca.key` (0600)."""

    directory: Path

    @property
    def cert_path(self) -> Path:
        return self.directory / "ca.crt"

    @property
    def key_path(self) -> Path:
        return self.directory / "ca.key"

    @classmethod
    def ensure(
        cls,
        directory: Path,
        *,
        days: int = 3650,
        min_ca_days_left: int = 30,
        now: dt.datetime | None = None,
    ) -> LocalCA:
        """The CA in `directory`, created (folder mode 0700) when missing, unreadable, or
        valid for less than `min_ca_days_left` more days; a new CA is valid for `days`.

        A re-created CA invalidates the leaves of the old one (`issue` re-issues them) and
        clients must trust the new `ca.crt`.

        Raises:
            OSError: the directory or the files cannot be written.
        """
        now = now or _utcnow()
        ca = cls(directory)
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        cert = _load_cert(ca.cert_path)
        if (
            cert is not None
            and ca.key_path.exists()
            and cert.not_valid_after_utc - now >= dt.timedelta(days=min_ca_days_left)
        ):
            return ca
        key = _new_key()
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, CA_NAME)])
        ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
        cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - _BACKDATE)
            .not_valid_after(now + dt.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(ski, critical=False)
            .sign(key, hashes.SHA256())
        )
        write_private_file(ca.key_path, _key_pem(key))
        _write_cert(ca.cert_path, cert)
        return ca

    def issue(
        self,
        name: str,
        *,
        dns_names: Sequence[str] = (),
        ip_addresses: Sequence[str] = (),
        days: int = 30,
        now: dt.datetime | None = None,
    ) -> IssuedCertificate:
        """The certificate of service `name` (`<name>.crt`, `<name>.key` beside the CA), valid
        for `days`, with these DNS and IP subject alternative names, serverAuth + clientAuth.

        Reused when it exists, names exactly these SANs, was signed by this CA, and has more
        than a third of its validity left; re-issued (new key) otherwise.

        Raises:
            ValueError: no SAN, a bad IP literal, `days` < 1, or a `name` that is not a plain
                file name. OSError: the files cannot be read or written.
        """
        if not dns_names and not ip_addresses:
            raise ValueError("a certificate needs at least one DNS name or IP address")
        if days < 1:
            raise ValueError(f"days must be >= 1, got {days}")
        if not name or Path(name).name != name or name == "ca" or name.startswith("."):
            raise ValueError(f"{name!r} is not a usable certificate name")
        now = now or _utcnow()
        sans = _sans(dns_names, ip_addresses)
        cert_path = self.directory / f"{name}.crt"
        key_path = self.directory / f"{name}.key"
        ca_cert = _load_cert(self.cert_path)
        if ca_cert is None:
            raise OSError(f"no readable CA certificate at {self.cert_path}")
        existing = _load_cert(cert_path)
        if (
            existing is not None
            and key_path.exists()
            and self._still_good(existing, ca_cert, sans, now)
        ):
            return IssuedCertificate(name, cert_path, key_path, existing.not_valid_after_utc)
        ca_key = serialization.load_pem_private_key(self.key_path.read_bytes(), password=None)
        if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
            raise ValueError(f"{self.key_path} is not an EC private key")
        key = _new_key()
        not_after = now + dt.timedelta(days=days)
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - _BACKDATE)
            .not_valid_after(not_after)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=False,
                    crl_sign=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(
                x509.ExtendedKeyUsage(
                    [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
                ),
                critical=False,
            )
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(
                x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False
            )
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                critical=False,
            )
            .sign(ca_key, hashes.SHA256())
        )
        # Key first: a reader that sees the new certificate finds its key already there.
        write_private_file(key_path, _key_pem(key))
        _write_cert(cert_path, cert)
        return IssuedCertificate(name, cert_path, key_path, cert.not_valid_after_utc)

    @staticmethod
    def _still_good(
        cert: x509.Certificate,
        ca_cert: x509.Certificate,
        sans: list[x509.GeneralName],
        now: dt.datetime,
    ) -> bool:
        try:
            cert.verify_directly_issued_by(ca_cert)
            current = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        except (ValueError, TypeError, InvalidSignature, x509.ExtensionNotFound):
            return False
        if set(current) != set(sans):
            return False
        lifetime = cert.not_valid_after_utc - cert.not_valid_before_utc
        return cert.not_valid_after_utc - now > lifetime / 3
