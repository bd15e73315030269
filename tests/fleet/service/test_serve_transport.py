"""The service's transport limits and TLS over real sockets (uvicorn in a thread on 127.0.0.1):
clients that send half a request and stall are closed after the read timeouts, connections
beyond the limit get 503 while the slow ones last, and HTTPS works with the configured
certificate."""

from __future__ import annotations

import datetime
import importlib.util
import socket
import ssl
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.fleet.service.serve_harness import (
    ALICE,
    MODEL,
    OPERATOR,
    bearer,
    make_app,
    make_config,
    serving,
)
from tests.fleet_support import served_configs, wait_until


@pytest.fixture(params=["h11", "httptools"])
def parser(request: pytest.FixtureRequest) -> str:
    """Each transport test runs on both HTTP parsers the service can use (``server.http``)."""
    if request.param == "httptools":
        pytest.importorskip("httptools")
    return str(request.param)


def _server(parser: str, **limits: object) -> dict[str, object]:
    return {"server": {"http": parser, **limits}}


def _connect(base: str) -> socket.socket:
    host, port = base.rsplit("//", 1)[1].split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    return sock


def _closed_by_server(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def test_a_stalled_request_head_is_closed_after_the_header_timeout(
    tmp_path: Path, parser: str
) -> None:
    config = make_config(tmp_path, keys=False, extra=_server(parser, header_timeout_s=0.5))
    app, _ = make_app(config)
    with serving(app, config) as base:
        silent = _connect(base)  # connects and never sends a byte
        partial = _connect(base)
        partial.sendall(b"POST /v1/lookup HTTP/1.1\r\nHost: x\r\nContent-Le")
        assert _closed_by_server(silent) == b""
        assert _closed_by_server(partial) == b""
        # a connection that keeps sending requests in time is served
        with httpx.Client(base_url=base) as client:
            for _ in range(3):
                assert client.get("/healthz").status_code == 200


def test_an_idle_keep_alive_connection_is_closed_after_keep_alive_s(
    tmp_path: Path, parser: str
) -> None:
    config = make_config(tmp_path, keys=False, extra=_server(parser, keep_alive_s=1))
    app, _ = make_app(config)
    with serving(app, config) as base:
        sock = _connect(base)
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")  # keep-alive by default
        answer = _closed_by_server(sock)  # the answer, then the close once idle
        assert answer.startswith(b"HTTP/1.1 200 ") and answer.endswith(b"}")


def test_a_stalled_body_gets_408_after_the_body_timeout(tmp_path: Path, parser: str) -> None:
    config = make_config(tmp_path, extra=_server(parser, body_timeout_s=0.5))
    app, _ = make_app(config)
    with serving(app, config) as base:
        sock = _connect(base)
        body = b'{"model": "m", "tokens": [1, 2, 3, 4]}'
        head = (
            f"POST /v1/lookup HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {ALICE}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        sock.sendall(head.encode() + body[:10])  # half the body, then nothing
        answer = _closed_by_server(sock)
        assert answer.startswith(b"HTTP/1.1 408 ")
        assert b'"type":"BodyTimeoutError"' in answer
        with httpx.Client(base_url=base) as client:
            metrics = client.get("/metrics", headers=bearer(OPERATOR)).text
        assert 'prefixcache_rejected_requests_total{key="alice-' in metrics
        assert 'reason="body_timeout"' in metrics


def test_past_the_limit_a_new_connection_takes_the_place_of_a_slow_one(
    tmp_path: Path, parser: str
) -> None:
    """Four connections trickling their heads hold the 4 connections served: a new client is
    answered (health checks and other requests alike: they got 503 before), the slow connection
    waiting longest closed to make room, and the others closed by the head timeout."""
    config = make_config(
        tmp_path, keys=False, extra=_server(parser, max_connections=4, header_timeout_s=1.0)
    )
    app, _ = make_app(config)
    with serving(app, config) as base:
        slow = [_connect(base) for _ in range(4)]
        for sock in slow:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHo")
        assert httpx.get(f"{base}/healthz", headers={"connection": "close"}).status_code == 200
        assert _closed_by_server(slow[0]) == b""  # it waited longest: closed for the new one
        assert httpx.get(f"{base}/v1/models", headers={"connection": "close"}).status_code == 200
        for sock in slow[1:]:
            assert _closed_by_server(sock) == b""  # by the head timeout
        wait_until(lambda: _healthy(base), "/healthz to answer")


def test_a_request_head_beyond_max_header_bytes_is_refused(tmp_path: Path) -> None:
    """On httptools a head over ``server.max_header_bytes`` gets a 431 with a JSON message and
    the connection is closed, whether sent at once, in pieces, or pipelined behind another
    request (h11 bounds only what it buffers of an incomplete head, with a 400)."""
    pytest.importorskip("httptools")
    config = make_config(tmp_path, keys=False, extra=_server("httptools", max_header_bytes=2048))
    app, _ = make_app(config)
    big = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 4000 + b"\r\n\r\n"
    small = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
    with serving(app, config) as base:
        for pieces in ([big], [big[:1500], big[1500:3000], big[3000:]], [small + big]):
            sock = _connect(base)
            for piece in pieces:
                try:
                    sock.sendall(piece)
                    time.sleep(0.05)
                except OSError:  # closed already
                    break
            answer = _closed_by_server(sock)
            refused = answer[answer.rfind(b"HTTP/1.1 ") :]
            assert refused.startswith(b"HTTP/1.1 431 "), answer[:80]
            assert b'"type":"RequestHeaderFieldsTooLarge"' in refused
        ok = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 1500 + b"\r\n\r\n"
        sock = _connect(base)
        sock.sendall(ok + ok + b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert _closed_by_server(sock).count(b"HTTP/1.1 200 ") == 3


def test_large_bodies_and_early_answers_are_not_taken_for_heads(
    tmp_path: Path, parser: str
) -> None:
    """Bytes of a body are never counted as a head: a head whose blank line is split across
    two packets, followed by a body larger than the head limit, is served, and after an early
    401 (the body left unread) the next request on the same connection is served."""
    config = make_config(tmp_path, extra=_server(parser, max_header_bytes=2048))
    app, _ = make_app(config)
    body = b'{"model": "' + MODEL.encode() + b'", "tokens": [' + b"1, " * 3000 + b"1]}"
    head = (
        f"POST /v1/lookup HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {ALICE}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    closing = b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    with serving(app, config) as base:
        sock = _connect(base)
        sock.sendall(head[:-1])
        time.sleep(0.2)  # the last byte of the head comes in the body's packet
        sock.sendall(head[-1:] + body + closing)
        answer = _closed_by_server(sock)
        assert answer.startswith(b"HTTP/1.1 200 ") and answer.count(b"HTTP/1.1 200 ") == 2
        sock = _connect(base)
        unauthorized = head.replace(f"Authorization: Bearer {ALICE}\r\n".encode(), b"")
        sock.sendall(unauthorized + body + closing)
        answer = _closed_by_server(sock)
        assert answer.startswith(b"HTTP/1.1 401 ") and b"HTTP/1.1 200 " in answer, answer[-300:]


def _base_protocol() -> type:
    """The uvicorn protocol ``server.http: auto`` builds on here."""
    from prefixcache.fleet.service.configuration.access_config import ServerConfig
    from prefixcache.fleet.service.transport import http_protocol

    return http_protocol(ServerConfig()).__mro__[1]


def _healthy(base: str) -> bool:
    try:
        return httpx.get(f"{base}/healthz", headers={"connection": "close"}).status_code == 200
    except httpx.TransportError:
        return False


def _self_signed(tmp: Path) -> tuple[Path, Path]:
    cert, key = tmp / "cert.pem", tmp / "key.pem"
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID
    except ImportError:
        if subprocess.run(["openssl", "version"], capture_output=True).returncode != 0:
            pytest.skip("neither the cryptography package nor openssl is available")
        subprocess.run(
            ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
             "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1",
             "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
            check=True, capture_output=True,
        )  # fmt: skip
        return cert, key
    import ipaddress

    private = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(private.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(private, hashes.SHA256())
    )
    cert.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key.write_bytes(
        private.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert, key


def test_tls_serves_https_with_the_configured_certificate(tmp_path: Path) -> None:
    cert, key = _self_signed(tmp_path)
    config = make_config(tmp_path, extra={"tls": {"certfile": "cert.pem", "keyfile": "key.pem"}})
    assert config.server.certfile == str(cert) and config.server.keyfile == str(key)
    app, _ = make_app(config)
    with serving(app, config) as base:
        assert base.startswith("https://")
        trust = ssl.create_default_context(cafile=str(cert))
        with httpx.Client(base_url=base, verify=trust) as client:
            assert client.get("/healthz").status_code == 200
            body = {"model": MODEL, "tokens": [1, 2, 3, 4]}
            assert client.post("/v1/lookup", json=body, headers=bearer(ALICE)).status_code == 200
            assert client.post("/v1/lookup", json=body).status_code == 401
        with pytest.raises(httpx.TransportError):  # plain HTTP is not answered
            httpx.get(base.replace("https://", "http://") + "/healthz", timeout=5)


def test_server_and_tls_config_errors_say_where(tmp_path: Path) -> None:
    from prefixcache.errors import ConfigError

    cases = [
        ({"server": {"header_timeout_s": 0}}, "server.header_timeout_s"),
        ({"server": {"max_connections": 0}}, "server.max_connections"),
        ({"server": {"max_header_bytes": 10}}, "server.max_header_bytes"),
        ({"server": {"slow": 1}}, "server: unknown key 'slow'"),
        ({"tls": {"certfile": "nowhere.pem", "keyfile": "nowhere.pem"}}, "tls.certfile: file"),
        ({"tls": {"certfile": "keys.yaml"}}, "tls: give both"),
    ]
    for extra, message in cases:
        with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
            make_config(tmp_path, extra=extra)
    assert (
        make_config(tmp_path, extra={"server": {"max_connections": None}}).server.max_connections
        is None
    )


def test_serve_passes_the_limits_and_tls_to_uvicorn_and_warns_when_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from prefixcache.cli import main
    from prefixcache.fleet.service.configuration.access_config import ServerConfig
    from prefixcache.fleet.service.transport import (
        ACCEPT_BATCH,
        HeadTimeoutProtocol,
        http_protocol,
    )

    cert, key = _self_signed(tmp_path)
    runs = served_configs(monkeypatch)
    path = tmp_path / "fleet.yaml"
    path.write_text(
        "replicas: [{name: r, model: m}]\nhealth: {probe_interval_s: null}\n"
        "server: {header_timeout_s: 3, keep_alive_s: 2, max_connections: 50}\n"
        f"tls: {{certfile: {cert.name}, keyfile: {key.name}}}\n"
    )
    assert main(["serve", "--config", str(path), "--host", "0.0.0.0"]) == 0
    (options,) = runs
    protocol = options.http
    assert isinstance(protocol, type) and protocol.__mro__[1] is _base_protocol()
    assert protocol.head_timeout_s == 3 and protocol.max_head_bytes == 16 * 1024
    h11 = http_protocol(ServerConfig(http="h11"))
    assert issubclass(h11, HeadTimeoutProtocol) and h11.max_head_bytes == 16 * 1024
    # the protocol answers 503 past max_connections (sparing health checks), not uvicorn
    assert options.limit_concurrency is None and protocol.shares.max_connections == 50
    assert options.timeout_keep_alive == 2
    assert options.ssl_certfile == str(cert) and options.ssl_keyfile == str(key)
    assert options.host == "0.0.0.0" and options.backlog == ACCEPT_BATCH
    assert "warning: listening on 0.0.0.0 without API keys" in capsys.readouterr().err


def test_workers_name_a_protocol_of_the_configured_parser() -> None:
    """``--workers`` hands uvicorn an import string: it names the parser ``server.http`` asks
    for, and the class keeps the head limits and turns Nagle's algorithm off."""
    from uvicorn.importer import import_from_string

    from prefixcache.fleet.service.configuration.access_config import ServerConfig
    from prefixcache.fleet.service.startup import worker_protocol
    from prefixcache.fleet.service.transport import HeadTimeoutProtocol

    h11 = import_from_string(worker_protocol(ServerConfig(http="h11")))
    assert issubclass(h11, HeadTimeoutProtocol)
    if importlib.util.find_spec("httptools") is not None:
        fast = import_from_string(worker_protocol(ServerConfig()))
        assert fast.__name__ == "WorkerHttpToolsProtocol"
        assert fast.__mro__[2] is _base_protocol()
