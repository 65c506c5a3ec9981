"""`forage tls certs` (services/common/cli_tls.py, tls_certs.py): the files it writes and keeps,
and that its certificates pass a real TLS handshake (Python's ssl, in memory) for the names the
deploy files dial and fail it for any other name or another set's CA."""

from __future__ import annotations

import ssl
import stat

import pytest

from services.cli import main
from services.common.tls_certs import RELAY_NAME

FILES = {"ca.crt", "redis.crt", "redis.key", "learner.crt", "learner.key", "relay.crt",
         "relay.key", "autoscaler.tls"}


def handshake(folder, server: str, name: str, ca_folder=None) -> None:
    """A TLS 1.2+ handshake between a server with `server`'s certificate and a client that
    trusts `ca_folder`'s CA (default: the same set) and dials `name`; raises ssl.SSLError."""
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(folder / f"{server}.crt", folder / f"{server}.key")
    client_ctx = ssl.create_default_context(cafile=str((ca_folder or folder) / "ca.crt"))
    wires = [ssl.MemoryBIO() for _ in range(4)]
    client = client_ctx.wrap_bio(wires[0], wires[1], server_hostname=name)
    other = server_ctx.wrap_bio(wires[2], wires[3], server_side=True)
    done = {client: False, other: False}
    for _ in range(20):
        for end in (client, other):
            if not done[end]:
                try:
                    end.do_handshake()
                    done[end] = True
                except ssl.SSLWantReadError:
                    pass
        wires[2].write(wires[1].read())  # client -> server
        wires[0].write(wires[3].read())  # server -> client
        if all(done.values()):
            return
    raise AssertionError("handshake did not finish")


@pytest.fixture(scope="module")
def cert_set(tmp_path_factory):
    out = tmp_path_factory.mktemp("tls") / "secrets" / "tls"
    assert main(["tls", "certs", "--out", str(out), "--namespace", "team-a",
                 "--learner-host", "10.0.0.7"]) == 0
    return out


def test_writes_the_set_privately_and_keeps_it_unless_rotate(cert_set, capsys):
    assert {p.name for p in cert_set.iterdir()} == FILES
    assert stat.S_IMODE(cert_set.stat().st_mode) == 0o700
    assert (cert_set / "autoscaler.tls").read_text().strip() == "enable"
    ca = (cert_set / "ca.crt").read_text()
    capsys.readouterr()
    assert main(["tls", "certs", "--out", str(cert_set)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--rotate" in err, err
    assert (cert_set / "ca.crt").read_text() == ca
    assert main(["tls", "certs", "--out", str(cert_set), "--days", "0"]) == 2
    assert "--days" in capsys.readouterr().err


def test_certificates_pass_for_the_deployed_names_only(cert_set, tmp_path):
    for name in ("redis", "redis.team-a.svc.cluster.local", "127.0.0.1", "localhost"):
        handshake(cert_set, "redis", name)
    for name in ("learner", "learner.team-a.svc", "10.0.0.7"):
        handshake(cert_set, "learner", name)
    handshake(cert_set, "relay", RELAY_NAME)
    for server, name in (("redis", "learner"), ("learner", "redis.forage.svc"),
                         ("relay", "10.0.0.7")):
        with pytest.raises(ssl.SSLCertVerificationError):
            handshake(cert_set, server, name)
    rotated = tmp_path / "rotated"
    assert main(["tls", "certs", "--out", str(rotated)]) == 0
    assert main(["tls", "certs", "--out", str(rotated), "--rotate"]) == 0
    with pytest.raises(ssl.SSLCertVerificationError):  # a new CA: the old set is not trusted
        handshake(cert_set, "redis", "redis", ca_folder=rotated)
