"""TLS for weight sync: the files the config names, read and checked, and gRPC credentials.

Off unless configured: the learner's weight server and a replica's relay serve TLS when they
have a certificate and key (`learner.weight_sync_tls_cert_file` / `_key_file`,
`rollout.weight_relay_tls_cert_file` / `_key_file`); clients dial TLS when they have the CA
(`learner.weight_sync_tls_ca_file`), with which they verify the learner and every relay. The
bearer token is sent and checked as before: TLS hides it and the weights on the wire, the token
still says who may fetch.

Files are checked with Python's `ssl` before gRPC sees them: gRPC reports a missing or
mismatched certificate only once a connection fails, far from the setting that caused it. A
bad file is a `ConfigError` naming the setting; a failed handshake becomes a one-line
`WeightSyncError` saying what is wrong and which setting to check (`explain`). A Unix socket
(a replica's tensor-parallel share) stays plain: it never leaves the host.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc

from services.common.config.base import ConfigError

CA_SETTING = "learner.weight_sync_tls_ca_file"
RELAY_NAME_SETTING = "rollout.weight_relay_tls_name"


@dataclass(frozen=True)
class ServerTls:
    """A server's certificate and key files, and the settings that named them (for errors)."""

    cert_file: str
    key_file: str
    cert_setting: str = "learner.weight_sync_tls_cert_file"
    key_setting: str = "learner.weight_sync_tls_key_file"

    def credentials(self) -> grpc.ServerCredentials:
        """gRPC server credentials, once the pair loaded as a matching certificate and key."""
        cert = _read(self.cert_file, self.cert_setting)
        key = _read(self.key_file, self.key_setting)
        try:
            ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(
                self.cert_file, self.key_file)
        except ssl.SSLError as exc:
            raise ConfigError(
                f"{self.cert_setting} {self.cert_file} and {self.key_setting} {self.key_file} "
                f"are not a PEM certificate and its private key ({exc.reason or exc})") from None
        return grpc.ssl_server_credentials([(key, cert)])


def relay_tls(cert_file: str, key_file: str) -> ServerTls:
    """A replica's relay certificate, named by its own settings."""
    return ServerTls(cert_file, key_file, "rollout.weight_relay_tls_cert_file",
                     "rollout.weight_relay_tls_key_file")


def channel_credentials(ca_file: str) -> grpc.ChannelCredentials:
    """Client credentials that trust only the CA in `ca_file` (learner.weight_sync_tls_ca_file)."""
    ca = _read(ca_file, CA_SETTING)
    try:
        ssl.create_default_context(cafile=ca_file)
    except ssl.SSLError as exc:
        raise ConfigError(f"{CA_SETTING} {ca_file} holds no PEM CA certificate "
                          f"({exc.reason or exc})") from None
    return grpc.ssl_channel_credentials(root_certificates=ca)


def _read(path: str, setting: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"{setting} {path} does not exist: mount the file there") from None
    except OSError as exc:
        raise ConfigError(f"{setting} {path} cannot be read: "
                          f"{exc.strerror or type(exc).__name__}") from None
    if not data.strip():
        raise ConfigError(f"{setting} {path} is empty")
    return data


def explain(details: str, tls: bool, where: str, ca_file: str = "") -> str | None:
    """What a failed connection to the weight server or relay at `where` means, when it is
    TLS's doing: one line naming the setting to check; None for any other failure.

    gRPC reports these as UNAVAILABLE with the TLS library's words in the details."""
    if not tls:
        # A TLS server closes a plain connection during the handshake.
        if "Socket closed" in details:
            return (f"{where} closed the connection: if it serves TLS, set {CA_SETTING} "
                    "to the CA that signed its certificate")
        return None
    if "CERTIFICATE_VERIFY_FAILED" in details:
        return (f"the certificate of {where} is not signed by the CA in {CA_SETTING} "
                f"({ca_file}), or has expired")
    if "Hostname Verification" in details or "No match found for server name" in details:
        return (f"the certificate of {where} does not name the host dialed: the learner's "
                "must name learner.weight_sync_host, a relay's its advertised host "
                f"(rollout.weight_relay_advertise) or {RELAY_NAME_SETTING}")
    if "WRONG_VERSION_NUMBER" in details or "handshake failed" in details.lower():
        return (f"{where} does not speak TLS, but {CA_SETTING} is set: give the server "
                "learner.weight_sync_tls_cert_file and _key_file (a relay: "
                "rollout.weight_relay_tls_cert_file and _key_file)")
    return None
