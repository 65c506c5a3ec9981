"""The certificates a deployment's TLS runs on (docs/deploy.md, "Security"): a private CA and
the server certificates it signs, made with `cryptography`.

Three servers speak TLS in the deploy files: Redis (`redis`), the learner's weight server
(`learner`) and every rollout replica's weight relay. Clients trust only the CA
(`ca.crt`) and check the server's name: Redis and the learner by the name they are dialled
at, which is the compose service name or the Kubernetes Service's DNS names; relays by the one
name every relay certificate carries (`RELAY_NAME`, `rollout.weight_relay_tls_name`), since
replicas dial each other by pod or container address. Each certificate also names
localhost and 127.0.0.1, for a healthcheck or a sidecar (the Redis exporter) in the same pod.

The CA's private key signs the set and is then dropped: nothing can issue another
certificate under it, and a new set (`--rotate`) makes a new CA. Everything here is pure.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass

# The servers of a deployment and the names every layout dials them by (the compose service,
# the Kubernetes Service); `names` adds the namespace's DNS forms.
SERVERS = ("redis", "learner")
RELAY = "relay"
RELAY_NAME = "forage-relay"
LOCAL_NAMES = ("localhost", "127.0.0.1")
CA_FILE = "ca.crt"


@dataclass(frozen=True)
class CertSet:
    """PEM text per file name: `ca.crt`, and `<server>.crt` / `<server>.key` per server."""

    files: dict[str, str]
    not_after: dt.datetime


def server_names(service: str, namespace: str, extra: tuple[str, ...] = ()) -> list[str]:
    """The names a server's certificate carries: its service name, the Kubernetes Service's DNS
    names in `namespace`, loopback, then `extra` (no duplicates, in that order)."""
    names = [service, f"{service}.{namespace}", f"{service}.{namespace}.svc",
             f"{service}.{namespace}.svc.cluster.local", *LOCAL_NAMES, *extra]
    return list(dict.fromkeys(names))


def _alt_name(text: str):
    from cryptography import x509

    try:
        return x509.IPAddress(ipaddress.ip_address(text))
    except ValueError:
        return x509.DNSName(text)


def _pem_key(key) -> str:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption()).decode()


def _pem_cert(cert) -> str:
    from cryptography.hazmat.primitives import serialization

    return cert.public_bytes(serialization.Encoding.PEM).decode()


def make_cert_set(names: dict[str, list[str]], days: int = 365,
                  now: dt.datetime | None = None) -> CertSet:
    """A fresh CA and, per entry of `names` (server -> the names its certificate carries, the
    first also its common name), a server certificate and key signed by it, valid `days`."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    if days < 1:
        raise ValueError(f"days must be at least 1 (got {days})")
    now = now or dt.datetime.now(dt.timezone.utc)
    start, end = now - dt.timedelta(minutes=5), now + dt.timedelta(days=days)

    def subject(text: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "forage"),
                          x509.NameAttribute(NameOID.COMMON_NAME, text)])

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = subject("forage deployment CA")
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(start).not_valid_after(end)
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False,
                                       key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, key_cert_sign=True, crl_sign=True,
                                       encipher_only=False, decipher_only=False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()),
                         critical=False)
          .sign(ca_key, hashes.SHA256()))
    files = {CA_FILE: _pem_cert(ca)}
    for server, alt_names in names.items():
        if not alt_names:
            raise ValueError(f"{server}: a server certificate needs at least one name")
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (x509.CertificateBuilder().subject_name(subject(alt_names[0]))
                .issuer_name(ca_name).public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(start).not_valid_after(end)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False,
                                             key_encipherment=True, data_encipherment=False,
                                             key_agreement=False, key_cert_sign=False,
                                             crl_sign=False, encipher_only=False,
                                             decipher_only=False), critical=True)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]),
                               critical=False)
                .add_extension(x509.SubjectAlternativeName([_alt_name(n) for n in alt_names]),
                               critical=False)
                .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                    ca_key.public_key()), critical=False)
                .sign(ca_key, hashes.SHA256()))
        files[f"{server}.crt"] = _pem_cert(cert)
        files[f"{server}.key"] = _pem_key(key)
    return CertSet(files, end)


def certificate_names(pem: str) -> list[str]:
    """The DNS names and addresses a PEM certificate carries (for messages and tests)."""
    from cryptography import x509

    cert = x509.load_pem_x509_certificate(pem.encode())
    alt = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return [str(v) for v in alt.get_values_for_type(x509.DNSName)] + [
        str(v) for v in alt.get_values_for_type(x509.IPAddress)]
