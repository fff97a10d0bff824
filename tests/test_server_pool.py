"""The rotation of rollout servers (opd.sampling.server_pool): who takes a row, who is out, when
one is tried again, and what the run is told. The real servers' side (a server killed, restarted
and taken back in sync) is in tests_vllm/test_vllm_rollout_servers.py."""

import pytest

from opd.errors import RolloutServerError
from opd.sampling.rollout_server import RolloutServer
from opd.sampling.server_pool import ServerPool

URLS = ["http://127.0.0.1:9001", "http://127.0.0.1:9002", "http://127.0.0.1:9003"]


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def pool_of(count: int, rank: int = 0, rest_s: float = 30):
    said: list[str] = []
    clock = Clock()
    servers = [RolloutServer(url, timeout_s=5) for url in URLS[:count]]
    return (
        ServerPool(servers, rest_s, rank=rank, warn=said.append, clock=clock),
        servers,
        said,
        clock,
    )


def failure(url: str) -> RolloutServerError:
    return RolloutServerError(f"rollout server {url}: cannot reach it (refused)", fault="silent")


def test_rows_go_round_the_servers_offset_by_rank():
    pool, _, _, _ = pool_of(3, rank=1)
    assert [pool.server_for(row).url for row in range(4)] == [URLS[1], URLS[2], URLS[0], URLS[1]]


def test_a_server_taken_out_gets_no_rows_and_is_said_once():
    pool, servers, said, _ = pool_of(3)
    pool.take_out(servers[1], failure(URLS[1]))
    pool.take_out(servers[1], failure(URLS[1]))
    assert [pool.server_for(row).url for row in range(4)] == [URLS[0], URLS[2], URLS[0], URLS[2]]
    assert len(said) == 1
    assert said[0].startswith(f"rollout server {URLS[1]} taken out of rotation (rollout server")
    assert "2 of 3 left" in said[0] and "after 30 s (student.rollout_rest_s)" in said[0]


def test_the_last_server_out_raises_naming_each_and_what_it_said():
    pool, servers, _, _ = pool_of(2)
    pool.take_out(servers[0], failure(URLS[0]))
    with pytest.raises(RolloutServerError) as raised:
        pool.take_out(
            servers[1], RolloutServerError(f"rollout server {URLS[1]}: HTTP 500", fault="answer")
        )
    message = str(raised.value)
    assert message.startswith("no rollout server is left in rotation (student.rollout_servers): ")
    assert f"rollout server {URLS[0]}: cannot reach it" in message
    assert f"rollout server {URLS[1]}: HTTP 500" in message
    with pytest.raises(RolloutServerError, match="no rollout server is left"):
        pool.server_for(0)


def test_a_single_server_lost_raises_what_it_said_unchanged():
    pool, servers, said, _ = pool_of(1)
    with pytest.raises(RolloutServerError) as raised:
        pool.take_out(servers[0], failure(URLS[0]))
    assert str(raised.value) == f"rollout server {URLS[0]}: cannot reach it (refused)"
    assert said == []


def test_a_resting_server_is_tried_once_per_rest_and_taken_back():
    pool, servers, said, clock = pool_of(3)
    pool.take_out(servers[2], failure(URLS[2]))
    clock.now += 29.9
    assert pool.resting() == []
    clock.now += 0.1
    assert pool.resting() == [servers[2]]
    assert pool.resting() == []  # its rest started again: one try until 30 s more
    clock.now += 30
    assert pool.resting() == [servers[2]]
    pool.take_back(servers[2], "opd-run-v3")
    assert pool.live() == servers
    assert (
        said[-1]
        == f"rollout server {URLS[2]} is back in rotation, serving opd-run-v3 (3 of 3 live)"
    )


def test_keep_makes_the_main_processs_view_the_rotation():
    pool, servers, _, _ = pool_of(3, rank=1)
    pool.take_out(servers[0], failure(URLS[0]))
    pool.keep([URLS[0], URLS[2]])
    assert pool.live() == [servers[0], servers[2]]
    assert pool.resting() == []  # just taken out: resting from now
