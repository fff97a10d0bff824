"""What a rollout server lets a client do, without vLLM: the key check opd adds to every route (a
real ASGI exchange with the middleware), the weight directory's bounds (links and ``..``
followed), and ``opd rollout-server`` refusing a host other machines reach while no key is set.
The same guards on a real vLLM server: tests_vllm/test_vllm_rollout_servers.py."""

from __future__ import annotations

import asyncio
import os

import pytest

from opd.cli import main
from opd.sampling.rollout_guard import KEY_ENV, RolloutAuth, files_outside, is_loopback


def exchange(middleware: RolloutAuth, path: str, headers: dict[bytes, bytes], method: str = "POST"):
    """``(status, body)`` of one HTTP request through ``middleware`` to an app that answers 200."""
    sent = []

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"reached the route"})

    middleware.app = app

    async def receive():
        return {"type": "http.request", "body": b"{}"}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": method, "path": path, "headers": list(headers.items())}
    asyncio.run(middleware(scope, receive, send))
    return sent[0]["status"], sent[1]["body"]


ROUTES = (
    "/update_weights",
    "/start_weight_update",
    "/collective_rpc",
    "/pause",
    "/v1/completions",
    "/tokenize",
)


def test_with_a_key_every_route_but_health_wants_it(monkeypatch):
    monkeypatch.setenv(KEY_ENV, "s3cret")
    guard = RolloutAuth(None)
    for path in ROUTES:
        assert exchange(guard, path, {})[0] == 401, path
        assert exchange(guard, path, {b"authorization": b"Bearer wrong"})[0] == 401, path
        assert exchange(guard, path, {b"authorization": b"Basic s3cret"})[0] == 401, path
        assert exchange(guard, path, {b"authorization": b"Bearer s3cret"}) == (
            200,
            b"reached the route",
        )
    assert exchange(guard, "/health", {}, "GET")[0] == 200
    _, body = exchange(guard, "/update_weights", {})
    assert b"API key" in body and b"s3cret" not in body


def test_without_a_key_it_passes_every_request_on(monkeypatch):
    monkeypatch.delenv(KEY_ENV, raising=False)
    guard = RolloutAuth(None)
    assert [exchange(guard, path, {})[0] for path in ROUTES] == [200] * len(ROUTES)


def test_weight_files_outside_the_directory_are_found_through_links_and_dots(tmp_path):
    root = (tmp_path / "weights").resolve()
    (root / "push-1").mkdir(parents=True)
    inside = root / "push-1" / "part-00000.safetensors"
    inside.write_bytes(b"")
    outside = tmp_path / "elsewhere.safetensors"
    outside.write_bytes(b"")
    link = root / "push-1" / "link.safetensors"
    link.symlink_to(outside)
    dotted = str(root / "push-1" / ".." / ".." / "elsewhere.safetensors")
    assert files_outside([str(inside)], root) == []
    assert files_outside([str(inside), str(link), dotted, "/etc/passwd"], root) == [
        str(link),
        dotted,
        "/etc/passwd",
    ]


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.0.0.2", True),
        ("::1", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("::", False),
        ("10.1.2.3", False),
        ("node7.cluster", False),
    ],
)
def test_loopback_hosts(host, loopback):
    assert is_loopback(host) is loopback


def test_a_host_others_reach_is_refused_without_a_key(monkeypatch, capsys):
    monkeypatch.delenv(KEY_ENV, raising=False)
    assert main(["rollout-server", "student-dir", "--host", "0.0.0.0"]) == 2
    error = capsys.readouterr().err
    assert error.startswith(
        "opd: error: opd rollout-server: --host 0.0.0.0 lets other machines reach"
    )
    assert KEY_ENV in error and "student.rollout_api_key_env" in error


def test_a_key_on_the_command_line_is_refused(monkeypatch, capsys):
    monkeypatch.setenv(KEY_ENV, "s3cret")
    assert main(["rollout-server", "student-dir", "--host", "0.0.0.0", "--api-key", "s3cret"]) == 2
    error = capsys.readouterr().err
    assert f"give the key in the environment variable {KEY_ENV}, not --api-key" in error
    assert "s3cret" not in error


def test_with_a_key_a_host_others_reach_goes_on_to_start_vllm(monkeypatch, capsys):
    """Past the host check: here (no vLLM in this environment) it stops at the install hint."""
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name: None if name == "vllm" else find_spec(name)
    )
    monkeypatch.setenv(KEY_ENV, "s3cret")
    assert main(["rollout-server", "student-dir", "--host", "0.0.0.0"]) == 2
    assert "pip install 'opd[vllm]'" in capsys.readouterr().err
    assert os.environ[KEY_ENV] == "s3cret"
