"""Test certificates: a private CA, and certificates it signs for 127.0.0.1 / localhost (a TLS
server on loopback) or for a client. Made with `cryptography`, in a folder the test owns."""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Pem:
    cert: str
    key: str


def _key():
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _write(folder: Path, name: str, cert, key) -> Pem:
    from cryptography.hazmat.primitives import serialization

    cert_path, key_path = folder / f"{name}.crt", folder / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    key_path.chmod(0o600)
    return Pem(str(cert_path), str(key_path))


def make_certs(folder: Path) -> dict[str, Pem]:
    """{"ca", "server" (127.0.0.1, localhost), "client", "other_ca"}: PEM files in `folder`."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = dt.datetime.now(dt.timezone.utc)

    def name(text: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, text)])

    def authority(label: str):
        key = _key()
        cert = (x509.CertificateBuilder().subject_name(name(label)).issuer_name(name(label))
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - dt.timedelta(minutes=5))
                .not_valid_after(now + dt.timedelta(days=1))
                .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                .add_extension(x509.KeyUsage(True, False, False, False, False, True, True, False,
                                             False), critical=True)
                .sign(key, hashes.SHA256()))
        return cert, key

    ca_cert, ca_key = authority("forage test CA")
    other_cert, other_key = authority("another CA")

    def leaf(label: str, usage, sans):
        key = _key()
        builder = (x509.CertificateBuilder().subject_name(name(label))
                   .issuer_name(ca_cert.subject).public_key(key.public_key())
                   .serial_number(x509.random_serial_number())
                   .not_valid_before(now - dt.timedelta(minutes=5))
                   .not_valid_after(now + dt.timedelta(days=1))
                   .add_extension(x509.ExtendedKeyUsage([usage]), critical=False))
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        return builder.sign(ca_key, hashes.SHA256()), key

    server = leaf("localhost", ExtendedKeyUsageOID.SERVER_AUTH,
                  [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    client = leaf("forage client", ExtendedKeyUsageOID.CLIENT_AUTH, [])
    return {"ca": _write(folder, "ca", ca_cert, ca_key),
            "other_ca": _write(folder, "other-ca", other_cert, other_key),
            "server": _write(folder, "server", *server),
            "client": _write(folder, "client", *client)}
