"""Mutual TLS from Python: the admin handle, a federated client and a sync worker present a
client certificate to a server that requires one (`serve --client-ca`)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

import hora
import hora.sync as hs
from conftest import Server, binary


def test_admin_client_and_ring_present_a_client_certificate(tmp_path: Path, monkeypatch):
    certs = tmp_path / "certs"
    subprocess.run([binary("hora-server"), "certs", "--dir", str(certs), "--client", "py"],
                   check=True, capture_output=True)
    ca, cert, key = certs / "ca.pem", certs / "py.pem", certs / "py-key.pem"
    server = Server(tmp_path, extra=["--tls-cert", str(certs / "server.pem"),
                                     "--tls-key", str(certs / "server-key.pem"),
                                     "--client-ca", str(ca)],
                    ca=ca, cert=cert, key=key)
    try:
        assert server.admin.tasks() == []
        with pytest.raises(ValueError, match="both cert= and key="):
            hora.Admin(server.url, ca, "x", cert=cert)
        # Without one, the refusal says what to give, at once.
        with pytest.raises(hora.HoraError, match="requires a client certificate"):
            hora.Admin(server.url, ca, "x").tasks()
        # A client enrols over mutual TLS, its certificate given by argument...
        client = hora.Client(server.url, ca, tmp_path / "client", token=server.enrol(),
                             cert=cert, key=key)
        assert client.id in {c["client_id"] for c in server.admin.clients()}
        # ...and a sync worker meets its job at the server, given it by the environment.
        job = server.admin.create_sync_job("tls-job", 1)
        monkeypatch.setenv("HORA_CLIENT_CERT", str(cert))
        monkeypatch.setenv("HORA_CLIENT_KEY", str(key))
        hs.init(server=server.url, ca=str(ca), job="tls-job", token=job["token"], size=1)
        assert (hs.rank(), hs.size()) == (0, 1)
    finally:
        hs.shutdown()
        server.kill()
