"""A teacher served by several replicas: requests go round them, a dead or faulty one leaves the
rotation and its requests go to the others, a returning one is probed and taken back, and a run
survives losing one with the scores it would have had from one server."""

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from opd.config import ConfigError, config_from_dict
from opd.runs.metrics import read_jsonl
from opd.teachers.base import TeacherInput, TeacherRequest
from opd.teachers.remote import RemoteTeacher, RemoteTeacherError
from opd.teachers.replicas import ReplicaPool, check_replicas
from opd.trainer.loop import Trainer
from tests.servers import free_port, start_opd_serve, wait_until_up

HERE = Path(__file__).parent
SEQUENCES = [[1, 5, 6, 7, 8, 2], [1, 9, 10], [1, 11, 12, 13, 14, 15, 16], [1, 20, 21, 22]]


def scored(teacher: RemoteTeacher) -> torch.Tensor:
    inputs = TeacherInput.from_sequences(SEQUENCES, [[1] * len(s) for s in SEQUENCES], pad_id=0)
    return teacher.score(inputs, TeacherRequest()).logprobs_BT


def url(port: int) -> str:
    return f"http://127.0.0.1:{port}/v1"


def stop(process: subprocess.Popen) -> None:
    process.kill()
    process.wait()


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_pool_goes_round_the_live_replicas_and_rests_the_failed():
    said, clock = [], Clock()
    pool = ReplicaPool(["http://a/v1", "http://b/v1/", "http://c/v1"], 10.0, said.append, clock)
    picks = [pool.choose(set())[0].base_url for _ in range(4)]
    assert picks == ["http://a/v1", "http://b/v1", "http://c/v1", "http://a/v1"]
    b = pool.replicas[1]
    pool.take_out(b, "connection refused")
    pool.take_out(b, "connection refused")  # said once
    assert said == [
        "teacher replica http://b/v1 taken out of rotation (connection refused); 2 of 3 left, it "
        "is probed again after 10 s"
    ]
    assert pool.live == 2
    tried: set[str] = set()
    order = []
    while (choice := pool.choose(tried)) is not None:
        order.append(choice)
        tried.add(choice[0].base_url)
    assert [(r.base_url, probe) for r, probe in order] == [
        ("http://c/v1", False),
        ("http://a/v1", False),
    ]
    clock.now += 10.0  # its rest is over: the next request probes it (one request, not each)
    assert pool.choose(set()) == (b, True)
    assert pool.choose(set())[0] is not b
    pool.take_back(b)
    assert pool.live == 3
    assert (
        said[-1]
        == "teacher replica http://b/v1 answers again and is back in rotation (3 of 3 live)"
    )

    alone = ReplicaPool(["http://a/v1"], 10.0, said.append, clock)
    pool_said = len(said)
    alone.take_out(alone.replicas[0], "refused")
    assert alone.choose(set()) == (alone.replicas[0], False)  # the only one: retried, no probe
    assert len(said) == pool_said  # one address: nothing to say about a rotation


def test_base_url_takes_a_list_and_checks_each_address():
    def config(base_url, **extra):
        teacher = {"model": "t", "backend": "openai", "base_url": base_url} | extra
        return {
            "student": {"model": "s"},
            "teacher": teacher,
            "datasets": [{"name": "d", "source": "reasoning_gym:chain_sum"}],
        }

    parsed = config_from_dict(config(["http://127.0.0.1:1/v1", "http://127.0.0.1:2/v1"]))
    assert parsed.teacher.base_url == ["http://127.0.0.1:1/v1", "http://127.0.0.1:2/v1"]
    refused = [
        (["http://127.0.0.1:1/v1", "ftp://x"], r"teacher\.base_url\[1\]: 'ftp://x' is not an http"),
        (["http://a:1/v1", "http://a:1/v1"], r"teacher\.base_url: names a replica twice"),
        ([], r"teacher\.base_url: required for backend 'openai'"),
    ]
    for base_url, message in refused:
        with pytest.raises(ConfigError, match=message):
            config_from_dict(config(base_url))
    with pytest.raises(ConfigError, match=r"teacher\.replica_rest_s: must be > 0"):
        config_from_dict(config("http://127.0.0.1:1/v1", replica_rest_s=0))


@pytest.fixture(scope="module")
def two_servers(model_dirs):
    """Two ``opd serve`` replicas of the teacher, started side by side."""
    ports = [free_port(), free_port()]
    processes = [start_opd_serve(model_dirs["teacher"], port, wait=False) for port in ports]
    for port, process in zip(ports, processes, strict=True):
        wait_until_up(port, process)
    yield ports, processes
    for process in processes:
        stop(process)


def test_a_dead_or_faulty_replica_leaves_the_rotation_and_the_scores_do_not_change(
    two_servers, capsys
):
    (port_a, port_b), _ = two_servers
    alone = scored(RemoteTeacher(backend="openai", base_url=url(port_a), model="teacher"))

    both = RemoteTeacher(
        backend="openai", base_url=[url(port_a), url(port_b)], model="teacher", request_batch_size=1
    )
    check_replicas(both, SEQUENCES[2], 2, "teacher")  # each address probed, and the two agree
    assert torch.allclose(scored(both), alone, atol=1e-5)

    dead = free_port()
    faulty = subprocess.Popen(
        [sys.executable, str(HERE / "fault_server.py"), "few", str(free_port())]
    )
    faulty_port = int(faulty.args[-1])
    try:
        wait_until_up(faulty_port, faulty, "/")
        for bad in (dead, faulty_port):
            teacher = RemoteTeacher(
                backend="openai",
                base_url=[url(bad), url(port_b)],
                model="teacher",
                request_batch_size=1,
            )
            assert torch.allclose(scored(teacher), alone, atol=1e-5)
            assert teacher.pool.live == 1
        warnings = capsys.readouterr().err
        assert f"teacher replica {url(dead)} taken out of rotation (" in warnings
        assert "refused" in warnings
        assert f"teacher replica {url(faulty_port)} taken out of rotation (sent" in warnings
        assert warnings.count("taken out of rotation") == 2  # once each, however many requests
    finally:
        stop(faulty)

    gone = RemoteTeacher(
        backend="openai",
        base_url=[url(free_port()), url(free_port())],
        model="t",
        max_retries=1,
        backoff_s=0.01,
    )
    with pytest.raises(
        RemoteTeacherError, match=r"every teacher replica failed, 2 attempts each \(http"
    ):
        scored(gone)


def test_a_replica_silent_at_the_start_starts_out_of_rotation_and_none_answering_is_refused(
    two_servers, capsys
):
    """A replica that does not answer the start's probe (down, or killed while it is asked) is
    left out with one warning and the others carry the run; none answering stops it by name."""
    (port_a, _), _ = two_servers
    dead = free_port()
    teacher = RemoteTeacher(
        backend="openai",
        base_url=[url(dead), url(port_a)],
        model="teacher",
        max_retries=1,
        backoff_s=0.01,
    )
    check_replicas(teacher, SEQUENCES[2], 2, "teacher")
    assert teacher.pool.live == 1 and not teacher.pool.replicas[0].live
    alone = RemoteTeacher(backend="openai", base_url=url(port_a), model="teacher")
    assert torch.equal(teacher.probe[1], alone.score_sequence(SEQUENCES[2]))
    said = capsys.readouterr().err
    assert (
        f"teacher replica {url(dead)} taken out of rotation (no answer to the start's probe: "
        in said
    )
    silent = RemoteTeacher(
        backend="openai",
        base_url=[url(dead), url(free_port())],
        model="t",
        max_retries=1,
        backoff_s=0.01,
    )
    with pytest.raises(
        RemoteTeacherError, match=r"teacher\.base_url: no teacher replica answered: "
    ):
        check_replicas(silent, SEQUENCES[2], 2, "teacher")


def test_a_replica_that_comes_back_is_probed_and_taken_back(two_servers, model_dirs, capsys):
    (port_a, _), _ = two_servers
    later = free_port()
    teacher = RemoteTeacher(
        backend="openai", base_url=[url(port_a), url(later)], model="teacher", replica_rest_s=0.2
    )
    teacher.probe = (SEQUENCES[2], teacher.score_sequence(SEQUENCES[2]))
    scored(teacher)
    assert teacher.pool.live == 1
    process = start_opd_serve(model_dirs["teacher"], later)
    try:
        threading.Event().wait(0.3)
        for _ in range(3):
            scored(teacher)
        assert teacher.pool.live == 2
        assert (
            f"teacher replica {url(later)} answers again and is back in rotation"
            in capsys.readouterr().err
        )
    finally:
        stop(process)

    other = subprocess.Popen([sys.executable, str(HERE / "fault_server.py"), "other", str(later)])
    try:  # back, but serving other log-probs
        wait_until_up(later, other, "/")
        teacher.pool.take_out(teacher.pool.replicas[1], "stopped")
        threading.Event().wait(0.3)
        scored(teacher)
        assert teacher.pool.live == 1
        assert "answers the probe" in capsys.readouterr().err
    finally:
        stop(other)


def test_a_run_outlives_a_replica_killed_mid_run_with_the_one_server_scores(
    two_servers, base_config, model_dirs, tmp_path
):
    """Two replicas, one killed after step 3 of 12: every step runs, each step's teacher KL that
    of the same run against one server, and the live count drops from 2 to 1."""
    (port_a, port_b), _ = two_servers
    spare = free_port()
    spare_process = start_opd_serve(model_dirs["teacher"], spare)

    def run(base_url, name: str, kill: subprocess.Popen | None = None) -> list[dict]:
        config = dict(
            base_config,
            log_path=str(tmp_path / name),
            teacher={
                "model": "teacher",
                "backend": "openai",
                "base_url": base_url,
                "tokenizer": str(model_dirs["teacher"]),
                "request_batch_size": 1,
            },
        )
        config["training"] = dict(config["training"], max_steps=12)
        trainer = Trainer(config_from_dict(config), progress=False)
        original = trainer.collect

        def collect(step):
            if step == 3 and kill is not None:
                stop(kill)
            return original(step)

        trainer.collect = collect
        trainer.run()
        return read_jsonl(tmp_path / name / "metrics.jsonl")

    try:
        one = run(url(port_a), "one")
        two = run([url(port_b), url(spare)], "two", kill=spare_process)
    finally:
        stop(spare_process)
    assert [r["step"] for r in two] == list(range(12))
    for alone, shared in zip(one, two, strict=True):
        assert shared["teacher_kl"] == pytest.approx(alone["teacher_kl"], abs=1e-5)
    assert [r["teacher/replicas_live"] for r in two[:3]] == [2.0] * 3
    assert [r["teacher/replicas_live"] for r in two[3:]] == [1.0] * 9
    assert "teacher/replicas_live" not in one[0]


def test_a_busy_server_is_asked_again_after_its_retry_after_and_stays_in_rotation(capsys):
    """Every other request answered 503 with ``Retry-After: 1``: each is sent again after the
    second it asks for, not the backoff (0.01 s here), and the server is never taken out."""
    port = free_port()
    busy = subprocess.Popen([sys.executable, str(HERE / "fault_server.py"), "busy", str(port)])
    try:
        wait_until_up(port, busy, "/")
        teacher = RemoteTeacher(
            backend="openai",
            base_url=[url(port)],
            model="t",
            max_retries=1,
            backoff_s=0.01,
            max_concurrency=1,
            request_batch_size=2,
        )
        started = time.monotonic()
        logprobs = scored(teacher)  # two requests, each refused once
        waited = time.monotonic() - started
        expected = [-1.0 - (t % 7) / 10 for t in SEQUENCES[0][1:]]
        assert logprobs[0, 1 : len(SEQUENCES[0])].tolist() == pytest.approx(expected)
        assert 2.0 <= waited < 5.0, waited
        assert teacher.pool.live == 1 and "taken out" not in capsys.readouterr().err
    finally:
        stop(busy)
