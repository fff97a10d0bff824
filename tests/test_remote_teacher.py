"""The remote teacher client against real server processes: `opd serve`, and faulty servers."""

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from opd.config import ConfigError, config_from_dict
from opd.models import PROBE_TEXTS
from opd.runs.checkpoints import list_checkpoints
from opd.runs.metrics import read_jsonl
from opd.sampling.hf_generate import HFGenerateSampler
from opd.teachers.base import TeacherInput, TeacherRequest
from opd.teachers.local import LocalTeacher
from opd.teachers.remote import RemoteTeacher, RemoteTeacherError
from opd.teachers.replicas import check_replicas
from opd.trainer.loop import Trainer, train
from tests.servers import free_port, start_opd_serve, through_server, wait_until_up

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def served_teacher(model_dirs):
    """One ``opd serve`` for the module's tests (each asserts it is still up where it matters):
    starting one costs seconds."""
    port = free_port()
    process = start_opd_serve(model_dirs["teacher"], port, "--max-logprobs", "5")
    yield port, process
    process.kill()
    process.wait()


def fault_server(mode):
    port = free_port()
    process = subprocess.Popen([sys.executable, str(HERE / "fault_server.py"), mode, str(port)])
    wait_until_up(port, process, "/")
    return port, process


SEQUENCES = [[1, 5, 6, 7, 8, 2], [1, 9, 10], [1, 11, 12, 13, 14, 15, 16]]
MASKS = [[0, 0, 1, 1, 1, 1], [0, 1, 1], [0, 0, 0, 1, 1, 1, 1]]


def padded(count: int = len(SEQUENCES)) -> TeacherInput:
    """The first ``count`` sequences and masks as one padded batch."""
    return TeacherInput.from_sequences(SEQUENCES[:count], MASKS[:count], pad_id=0)


def local_teacher(model_dirs):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dirs["teacher"])
    return LocalTeacher(model, vocab_size=103, pad_id=0)


@pytest.mark.parametrize("backend", ["openai", "sglang"])
def test_remote_scores_equal_local(served_teacher, model_dirs, backend):
    port, _ = served_teacher
    base_url = f"http://127.0.0.1:{port}" + ("/v1" if backend == "openai" else "")
    remote = RemoteTeacher(
        backend=backend, base_url=base_url, model="teacher", request_batch_size=2
    )
    got = remote.score(padded(), TeacherRequest(topk=3))
    expected = local_teacher(model_dirs).score(padded(), TeacherRequest(topk=3))
    scored = padded().score_mask_BT
    scored[:, 0] = False
    for a, b in zip(got.logprobs_BT, expected.logprobs_BT, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    for a, b in zip(got.topk_ids_BTK[scored], expected.topk_ids_BTK[scored], strict=True):
        assert torch.equal(a, b)
    for a, b in zip(got.topk_logprobs_BTK[scored], expected.topk_logprobs_BTK[scored], strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_a_run_through_the_server_reproduces_the_local_run(served_teacher, base_config, tmp_path):
    port, _ = served_teacher
    local = train(config_from_dict(base_config), progress=False)
    remote = train(
        config_from_dict(through_server(base_config, port, tmp_path / "remote")), progress=False
    )
    for a, b in zip(local.metrics, remote.metrics, strict=True):
        for key in ("teacher_kl", "loss", "entropy", "grad_norm", "num_tokens"):
            assert a[key] == pytest.approx(b[key], abs=1e-5), key


def test_server_rejects_malformed_requests_and_keeps_serving(served_teacher):
    port, process = served_teacher
    url = f"http://127.0.0.1:{port}/v1/completions"
    bad_requests = [
        b"{not json",
        json.dumps(
            {"model": "teacher", "prompt": "text, not ids", "prompt_logprobs": 0, "max_tokens": 1}
        ).encode(),
        json.dumps(
            {"model": "teacher", "prompt": [1, 2], "prompt_logprobs": 6, "max_tokens": 1}
        ).encode(),
        json.dumps(
            {"model": "other", "prompt": [1, 2], "prompt_logprobs": 0, "max_tokens": 1}
        ).encode(),
        json.dumps(
            {"model": "teacher", "prompt": [1, 99999], "prompt_logprobs": 0, "max_tokens": 1}
        ).encode(),
    ]
    for body in bad_requests:
        request = urllib.request.Request(
            url, data=body, headers={"Content-Type": "application/json"}
        )
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(request, timeout=10)
        assert caught.value.code == (404 if b'"other"' in body else 400)
        assert json.loads(caught.value.read())["error"]["code"] == caught.value.code  # vLLM's shape
    assert process.poll() is None
    models = json.loads(
        urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5).read()
    )
    assert models["data"][0]["id"] == "teacher"


@pytest.mark.parametrize(
    ("make_teacher", "message"),
    [
        (
            lambda port: RemoteTeacher(
                backend="openai", base_url=f"http://127.0.0.1:{port}/v1", model="other"
            ),
            r"HTTP 404: The model `other` does not exist\. Valid aliases: teacher\.; set "
            r"teacher\.model",
        ),
        (
            lambda port: RemoteTeacher(
                backend="openai", base_url=f"http://127.0.0.1:{port}/v1", model="teacher"
            ),
            r"HTTP 400: .*greater than max allowed: 5 .*; start the server with a larger "
            r"--max-logprobs",
        ),
    ],
)
def test_wrong_model_name_and_capped_logprobs_are_clear_errors(
    served_teacher, make_teacher, message
):
    port, _ = served_teacher
    with pytest.raises(RemoteTeacherError, match=message):
        make_teacher(port).score(
            padded(), TeacherRequest(topk=8 if "max allowed" in message else 0)
        )


def test_unreachable_server_fails_after_retries():
    port = free_port()
    teacher = RemoteTeacher(
        backend="openai",
        base_url=f"http://127.0.0.1:{port}/v1",
        model="t",
        max_retries=2,
        backoff_s=0.01,
    )
    started = time.monotonic()
    with pytest.raises(
        RemoteTeacherError,
        match=rf"127\.0\.0\.1:{port}/v1/completions failed after 3 attempts: .*refused",
    ):
        teacher.score(padded(), TeacherRequest())
    assert time.monotonic() - started < 10


@pytest.mark.parametrize(
    ("mode", "message"),
    [
        ("slow", r"failed after 2 attempts: timed out after 0\.5s"),
        ("few", r"sent 5 prompt log-probs for 6 tokens"),
        ("wrong_ids", r"no log-prob for token id 5 at position 1"),
        ("badjson", r"malformed JSON: b'<html>"),
        ("error500", r"failed after 2 attempts: HTTP 500: .*overloaded"),
        ("nan", r"log-prob nan at position 5 is not a finite number"),
    ],
)
def test_faulty_servers_give_clear_errors(mode, message):
    port, process = fault_server(mode)
    try:
        teacher = RemoteTeacher(
            backend="openai",
            base_url=f"http://127.0.0.1:{port}/v1",
            model="t",
            timeout_s=0.5,
            max_retries=1,
            backoff_s=0.01,
        )
        with pytest.raises(RemoteTeacherError, match=message):
            teacher.score(padded(1), TeacherRequest())
    finally:
        process.kill()
        process.wait()


def test_no_step_is_applied_when_the_server_fails(base_config, model_dirs, char_tokenizer):
    """A server failing mid-run (here from its first answer: the probe is off) fails the step
    before the update; with the probe on, the same server is refused before the run starts."""
    port, process = fault_server("few")
    try:
        config = dict(
            base_config,
            teacher={
                "model": "t",
                "backend": "openai",
                "base_url": f"http://127.0.0.1:{port}/v1",
                "max_retries": 0,
                "tokenizer": str(model_dirs["teacher"]),
            },
        )
        probe = len(char_tokenizer.encode(" ".join(PROBE_TEXTS), add_special_tokens=False))
        with pytest.raises(
            RemoteTeacherError, match=f"sent {probe - 1} prompt log-probs for {probe} tokens"
        ):
            Trainer(config_from_dict(config), progress=False)
        config["teacher"]["replica_probes"] = 0
        trainer = Trainer(config_from_dict(config), progress=False)
        before = {k: v.clone() for k, v in trainer.parts.student.state_dict().items()}
        with pytest.raises(RemoteTeacherError):
            trainer.train_step(0)
        assert all(torch.equal(v, before[k]) for k, v in trainer.parts.student.state_dict().items())
    finally:
        process.kill()
        process.wait()


def test_server_killed_mid_run_stops_cleanly_and_the_run_resumes_later(
    base_config, model_dirs, tmp_path
):
    import yaml

    port = free_port()
    config = dict(
        base_config,
        save_every=1,
        teacher={
            "model": "teacher",
            "backend": "openai",
            "base_url": f"http://127.0.0.1:{port}/v1",
            "tokenizer": str(model_dirs["teacher"]),
            "max_retries": 1,
            "timeout_s": 5,
        },
    )
    config["training"] = dict(config["training"], max_steps=4)
    path = tmp_path / "remote.yaml"
    path.write_text(yaml.safe_dump(config))
    server = start_opd_serve(model_dirs["teacher"], port)
    trainer = Trainer(config_from_dict(config), progress=False)
    original_collect = trainer.collect

    def kill_after_two(step):
        if step == 2:
            server.kill()
            server.wait()
        return original_collect(step)

    trainer.collect = kill_after_two
    with pytest.raises(RemoteTeacherError, match="failed after 2 attempts"):
        trainer.run()
    assert [r.step for r in list_checkpoints(tmp_path / "run")] == [1, 2]
    assert [r["step"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl")] == [0, 1]

    server = start_opd_serve(model_dirs["teacher"], port)
    try:
        result = subprocess.run(
            [sys.executable, "-m", "opd.cli", "train", str(path), "--no-progress"],
            capture_output=True,
            text=True,
        )
        assert result.returncode == 0, result.stderr
    finally:
        server.kill()
        server.wait()
    assert [r["step"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl")] == [0, 1, 2, 3]


@pytest.mark.parametrize(
    ("teacher", "training", "message"),
    [
        ({"backend": "openai"}, {}, r"teacher\.base_url: required for backend 'openai'"),
        (
            {"backend": "openai", "base_url": "http://x/v1"},
            {"objective": "jsd"},
            r"'jsd' needs the teacher's full distribution",
        ),
        (
            {"backend": "sglang", "base_url": "http://x"},
            {"objective": "nll", "data_source": "teacher"},
            r"training\.data_source: 'teacher' has the teacher write completions, which teacher "
            r"\(backend "
            r"'sglang'\) cannot",
        ),
    ],
)
def test_remote_configs_that_cannot_work_are_refused(base_config, teacher, training, message):
    config = dict(base_config, teacher=dict(base_config["teacher"], **teacher))
    config["training"] = dict(base_config["training"], **training)
    with pytest.raises(ConfigError, match=message):
        config_from_dict(config)


def test_api_key_comes_from_the_named_variable_and_is_never_written(
    served_teacher, base_config, model_dirs, tmp_path, monkeypatch
):
    port, _ = served_teacher
    with pytest.raises(RemoteTeacherError, match="environment variable OPD_TEST_KEY is not set"):
        RemoteTeacher(
            backend="openai",
            base_url="http://127.0.0.1:1/v1",
            model="t",
            api_key_env="OPD_TEST_KEY",
        )
    monkeypatch.setenv("OPD_TEST_KEY", "sk-secret-value-42")
    config = dict(
        base_config,
        teacher={
            "model": "teacher",
            "backend": "openai",
            "base_url": f"http://127.0.0.1:{port}/v1",
            "api_key_env": "OPD_TEST_KEY",
            "tokenizer": str(model_dirs["teacher"]),
        },
    )
    train(config_from_dict(config), progress=False)
    for path in (tmp_path / "run").rglob("*"):
        if path.is_file():
            assert b"sk-secret-value-42" not in path.read_bytes()


def naive_greedy(model, prompt: list[int], steps: int, stop: int) -> list[int]:
    """Greedy decoding one full forward a token: the most likely id until the stop id."""
    ids = list(prompt)
    for _ in range(steps):
        with torch.no_grad():
            token = int(model(torch.tensor([ids])).logits[0, -1].argmax())
        ids.append(token)
        if token == stop:
            break
    return ids[len(prompt) :]


def test_served_samples_are_the_local_teachers(served_teacher, model_dirs, char_tokenizer):
    """The served teacher writes what the same model writes in process from the same seeds; its
    log-probs are the model's own scores of those tokens; at temperature 0 it decodes greedily."""
    port, _ = served_teacher
    remote = RemoteTeacher(
        backend="openai", base_url=f"http://127.0.0.1:{port}/v1", model="teacher"
    )
    prompts = [[1, 5, 6, 7], [1, 9, 10], [1, 11, 12, 13, 14]]
    seeds = [5, 6, 2**62 + 7]
    served = remote.sample(
        prompts, temperature=1.0, max_tokens=12, seeds=seeds, stop_token_ids=[2], stop_strings=[]
    )
    model = local_teacher(model_dirs).model
    local = HFGenerateSampler(model, char_tokenizer, stop_token_ids=[2]).sample(
        prompts, temperature=1.0, max_tokens=12, seed=seeds
    )
    assert [c.token_ids for c in served] == [c.token_ids for c in local]
    assert [c.finished for c in served] == [c.finished for c in local]
    scored = local_teacher(model_dirs).score(
        TeacherInput.from_sequences(
            [p + c.token_ids for p, c in zip(prompts, served, strict=True)],
            [[0] * len(p) + [1] * len(c.token_ids) for p, c in zip(prompts, served, strict=True)],
            pad_id=0,
        ),
        TeacherRequest(),
    )
    for row, (prompt, completion) in enumerate(zip(prompts, served, strict=True)):
        width = len(completion.token_ids)
        expected = scored.logprobs_BT[row, len(prompt) : len(prompt) + width]
        torch.testing.assert_close(torch.tensor(completion.logprobs), expected, atol=1e-4, rtol=0)
    (greedy,) = remote.sample(
        prompts[:1], temperature=0.0, max_tokens=12, seeds=[0], stop_token_ids=[2], stop_strings=[]
    )
    assert greedy.token_ids == naive_greedy(model, prompts[0], 12, 2)


def test_a_run_on_a_served_teachers_samples_reproduces_the_local_run(
    served_teacher, base_config, tmp_path
):
    """``mixed``: the teacher's steps written on the server are the local teacher's, so every step's
    figures match (the top-k forward KL on both sources, scored through the server)."""
    port, _ = served_teacher
    base_config["training"] |= {
        "objective": {"name": "topk_forward_kl", "topk": 5},
        "data_source": "mixed",
        "lmbda": 0.5,
        "max_steps": 4,
    }
    local = train(config_from_dict(base_config), progress=False)
    remote = train(
        config_from_dict(through_server(base_config, port, tmp_path / "remote")), progress=False
    )
    assert {row["on_policy"] for row in local.metrics if "on_policy" in row} == {0, 1}
    for a, b in zip(local.metrics, remote.metrics, strict=True):
        assert a.get("on_policy") == b.get("on_policy")
        for key in ("loss", "entropy", "grad_norm", "num_tokens"):
            if key in a:
                assert a[key] == pytest.approx(b[key], abs=1e-5), key


def test_sampling_settings_the_server_does_not_serve_are_refused(served_teacher):
    port, process = served_teacher
    refused = [
        ({"top_p": 0.9}, "top_p"),
        ({"logprobs": 3}, "logprobs"),
        ({"n": 2}, "n"),
        ({"seed": -1}, "seed"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"stop": [""]}, "stop"),
        ({"temperature": "hot"}, "temperature"),
    ]
    for change, field in refused:
        body = {"model": "teacher", "prompt": [1, 5, 6], "max_tokens": 4} | change
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(request, timeout=10)
        assert caught.value.code == 400, change
        assert f"'{field}'" in json.loads(caught.value.read())["error"]["message"], change
    assert process.poll() is None


def test_replicas_that_disagree_are_refused_before_any_work(base_config, model_dirs, tmp_path):
    """Two models behind one address (every other answer another model's, as a round-robin
    balancer over two servers of different weights gives): opd train stops before any step,
    naming the address and the gap; one model's answers pass; replica_probes: 0 lets it run."""
    port, process = fault_server("replicas")
    try:
        teacher = RemoteTeacher(backend="openai", base_url=f"http://127.0.0.1:{port}/v1", model="t")
        ids = list(range(1, 40))
        honest = torch.tensor([0.0] + [-1.0 - (t % 7) / 10 for t in ids[1:]])
        other = torch.tensor([0.0] + [-2.0 - (t % 5) / 10 for t in ids[1:]])
        gap = (honest - other).abs()[1:]
        with pytest.raises(RemoteTeacherError) as refused:
            check_replicas(teacher, ids, 4, "teacher")
        assert (
            f"{gap.mean().item():.3f} nats a token apart on average (at most "
            f"{gap.max().item():.3f})" in str(refused.value)
        )
        assert "on request 2 of 4" in str(refused.value)
        check_replicas(teacher, ids, 1, "teacher")  # one probe compares nothing

        config = dict(
            base_config,
            log_path=str(tmp_path / "run"),
            teacher={
                "model": "t",
                "backend": "openai",
                "base_url": f"http://127.0.0.1:{port}/v1",
                "tokenizer": str(model_dirs["teacher"]),
            },
        )
        path = tmp_path / "replicas.yaml"
        path.write_text(json.dumps(config))
        result = subprocess.run(
            [sys.executable, "-m", "opd", "train", str(path), "--no-progress"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert result.returncode == 2, result.stderr
        assert "Traceback" not in result.stderr
        address = f"http://127.0.0.1:{port}/v1/completions"
        assert (
            f"teacher.base_url: the teacher server {address} answered the same probe"
            in result.stderr
        )
        assert "replica_probes: 0" in result.stderr
        assert read_jsonl(tmp_path / "run" / "metrics.jsonl") == []

        config["teacher"]["replica_probes"] = 0
        config["training"] = dict(base_config["training"], max_steps=1)
        assert len(train(config_from_dict(config), progress=False).metrics) >= 1
    finally:
        process.kill()
        process.wait()


def test_replica_probes_is_checked_with_the_teacher():
    with pytest.raises(ConfigError, match=r"teacher.replica_probes: must be >= 0, got -1"):
        config_from_dict(
            {
                "student": {"model": "s"},
                "teacher": {
                    "model": "t",
                    "backend": "openai",
                    "base_url": "http://127.0.0.1:1/v1",
                    "replica_probes": -1,
                },
                "datasets": [{"name": "d", "source": "reasoning_gym:chain_sum"}],
            }
        )
