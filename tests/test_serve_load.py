"""``opd serve`` as a real process under load and abuse: concurrent clients get the answers a lone
client gets, bodies are size-capped, slow clients are dropped, clients past the connection cap
wait their turn, and malformed bytes of any kind get a 4xx while the server stays up.

Throughput, latency and memory figures come from ``bench/serve_load.py`` (docs/reliability.md).
"""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.servers import free_port, start_opd_serve


@pytest.fixture(scope="module")
def server(model_dirs):
    port = free_port()
    process = start_opd_serve(
        model_dirs["teacher"],
        port,
        "--max-logprobs",
        "5",
        "--max-request-bytes",
        "65536",
        "--request-timeout",
        "1",
        "--max-connections",
        "8",
    )
    yield port, process
    process.kill()
    process.wait()


def post(
    port: int, body: bytes, path: str = "/v1/completions", timeout: float = 30
) -> tuple[int, dict]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", data=body, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def raw(port: int, data: bytes, timeout: float = 10) -> bytes:
    """Send bytes as they are; the server's whole answer (until it closes or goes quiet)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as connection:
        connection.sendall(data)
        connection.shutdown(socket.SHUT_WR)
        chunks = []
        while chunk := connection.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def status_of(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1])


def healthy(port: int) -> bool:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as response:
        return response.status == 200


def completion(ids: list[list[int]], k: int = 2) -> bytes:
    return json.dumps(
        {"model": "teacher", "prompt": ids, "prompt_logprobs": k, "max_tokens": 1}
    ).encode()


def test_concurrent_answers_equal_sequential_ones(server):
    port, process = server
    prompts = [[[1, *(3 + (i * 7 + j) % 90 for j in range(4 + i % 9))]] for i in range(48)]
    sequential = [post(port, completion(p)) for p in prompts]
    with ThreadPoolExecutor(max_workers=16) as pool:  # twice the connection cap: half of them queue
        concurrent = list(pool.map(lambda p: post(port, completion(p)), prompts))
    for (status_a, a), (status_b, b) in zip(sequential, concurrent, strict=True):
        assert status_a == status_b == 200
        assert a["choices"][0]["prompt_logprobs"] == b["choices"][0]["prompt_logprobs"]
    assert process.poll() is None


def test_bodies_over_the_limit_get_413_before_being_read(server):
    port, _ = server
    answer = raw(
        port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 10000000\r\n\r\n"
    )
    assert status_of(answer) == 413
    assert b"--max-request-bytes" in answer
    assert healthy(port)


@pytest.mark.parametrize(
    ("request_bytes", "expected"),
    [
        (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n\r\n", 411),
        (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n", 400),
        (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 12abc\r\n\r\n", 400),
        (b"POST /nowhere HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}", 404),
        (b"POST /v1/completions HTTP/1.1\r\nContent-Length: 6\r\n\r\n\xff\xfe\x00{}]", 400),
        (b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\n\r\n", 414),
    ],
)
def test_malformed_http_gets_a_4xx(server, request_bytes, expected):
    port, _ = server
    assert status_of(raw(port, request_bytes)) == expected
    assert healthy(port)


def test_deeply_nested_json_gets_400(server):
    port, _ = server
    status, body = post(port, b"[" * 30000 + b"]" * 30000)
    assert status == 400 and "nested too deeply" in body["error"]["message"]
    assert healthy(port)


@given(st.binary(max_size=300))
@settings(suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
def test_any_bytes_as_a_body_get_a_4xx_or_an_answer(server, body):
    port, process = server
    status, answer = post(port, body)
    assert status == 200 or 400 <= status < 500, (status, answer)
    assert process.poll() is None


def test_a_slow_client_is_dropped_and_does_not_hold_up_others(server):
    port, _ = server
    stalled = socket.create_connection(("127.0.0.1", port), timeout=10)
    stalled.sendall(b'POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"pro')
    started = time.monotonic()
    assert post(port, completion([[1, 5, 6]]))[0] == 200  # served while the slow one waits
    answer = stalled.recv(65536)  # the server gives up on it after --request-timeout (1 s)
    waited = time.monotonic() - started
    stalled.close()
    assert answer == b"" or status_of(answer) == 408
    assert waited < 5


def test_clients_past_the_connection_cap_wait_their_turn_and_are_answered(server):
    """Every slot held by an idle client: the next requests queue, and are answered once the idle
    ones are dropped (after --request-timeout, 1 s here), none refused."""
    port, _ = server
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(8)]
    try:
        time.sleep(0.2)
        started = time.monotonic()
        with ThreadPoolExecutor(max_workers=4) as pool:
            answers = list(
                pool.map(
                    lambda ids: post(port, completion([ids])), ([1, 5], [1, 6], [1, 7], [1, 8])
                )
            )
        waited = time.monotonic() - started
    finally:
        for connection in idle:
            connection.close()
    assert [status for status, _ in answers] == [200] * 4
    assert 0.5 < waited < 10  # queued behind the idle clients until they were dropped
    assert healthy(port)


def sample_body(prompts: list[list[int]], max_tokens: int, **extra) -> bytes:
    return json.dumps(
        {
            "model": "teacher",
            "prompt": prompts,
            "max_tokens": max_tokens,
            "return_token_ids": True,
            **extra,
        }
    ).encode()


def test_max_tokens_past_the_context_or_the_request_budget_gets_400_naming_the_numbers(server):
    """The tiny teacher's context is 256 tokens; the server keeps its default budget (16384 a
    request)."""
    port, _ = server
    status, answer = post(port, sample_body([[1] + [5] * 9], 247))
    assert status == 400
    message = answer["error"]["message"]
    assert (
        "maximum context length is 256" in message and "'max_tokens' can be at most 246" in message
    )
    assert answer["error"]["param"] == "max_tokens"
    status, answer = post(port, sample_body([[1, 5]] * 70, 240))
    assert status == 400
    message = answer["error"]["message"]
    assert "16800 tokens (70 prompts x max_tokens 240)" in message
    assert "limit of 16384" in message and "--max-tokens-per-request" in message
    assert (
        post(port, sample_body([[1] + [5] * 9], 246, stop_token_ids=[2]))[0] == 200
    )  # at the bound
    assert healthy(port)


def test_clients_sampling_and_scoring_at_once_get_what_each_gets_alone(server):
    """Six clients sample at once (seeded, to the end of their tokens) while a seventh scores: every
    request is answered 200 with the tokens it gets alone. A request whose rows were taken into
    another's batch while that batch decoded (it hands the model over between steps) used to take
    an empty batch of its own and answer 500."""
    port, _ = server

    def body(client: int) -> bytes:
        prompts = [[1, 6 + client, 7 + row % 3] for row in range(8)]
        seeds = {"seed": 1000 + client}
        return sample_body(
            prompts, 40, ignore_eos=True, stop_token_ids=[NEVER], temperature=1.0, **seeds
        )

    alone = [post(port, body(client)) for client in range(6)]
    assert all(status == 200 for status, _ in alone), alone
    scoring = completion([[1, 5, 6, 7] * 4])
    scored_alone = post(port, scoring)
    for _ in range(3):  # the interleaving moves from run to run: three rounds
        with ThreadPoolExecutor(max_workers=7) as pool:
            crowd = [
                pool.submit(post, port, body(client), "/v1/completions", 120) for client in range(6)
            ]
            scored = [pool.submit(post, port, scoring) for _ in range(4)]
            answers = [future.result() for future in crowd]
        assert [status for status, _ in answers] == [200] * 6, [a for s, a in answers if s != 200]
        for (_, got), (_, expected) in zip(answers, alone, strict=True):
            assert [c["token_ids"] for c in got["choices"]] == [
                c["token_ids"] for c in expected["choices"]
            ]
        for future in scored:
            status, answer = future.result()
            assert status == 200 and answer["choices"] == scored_alone[1]["choices"], answer
    assert healthy(port)


def test_past_its_waiting_cap_the_server_answers_503_with_retry_after_and_loses_nothing(model_dirs):
    """Six sampling clients and a scoring one at once against ``--max-waiting 2``: each is answered
    200 or 503 with a ``Retry-After`` (at least one 503: the queue is bounded), and a refused
    request sent again after it gets what it gets alone."""
    port = free_port()
    process = start_opd_serve(model_dirs["teacher"], port, "--max-waiting", "2")
    try:

        def body(client: int) -> bytes:
            prompts = [[1, 6 + client, 7 + row % 3] for row in range(4)]
            return sample_body(prompts, 30, ignore_eos=True, stop_token_ids=[NEVER], seed=client)

        def send(data: bytes) -> tuple[int, dict, str | None]:
            request = urllib.request.Request(
                f"http://127.0.0.1:{port}/v1/completions",
                data=data,
                headers={"Content-Type": "application/json"},
            )
            try:
                with urllib.request.urlopen(request, timeout=120) as response:
                    return response.status, json.loads(response.read()), None
            except urllib.error.HTTPError as error:
                return error.code, json.loads(error.read()), error.headers.get("Retry-After")

        bodies = [body(client) for client in range(6)] + [completion([[1, 5, 6, 7] * 4])]
        alone = [send(data)[1] for data in bodies]
        with ThreadPoolExecutor(max_workers=7) as pool:
            crowd = list(pool.map(send, bodies))
        refused = [index for index, (status, _, _) in enumerate(crowd) if status != 200]
        assert refused, "no request was refused: the cap was never reached"
        for index in refused:
            status, answer, retry_after = crowd[index]
            assert status == 503 and retry_after is not None and int(retry_after) >= 1, crowd[index]
            assert "--max-waiting" in answer["error"]["message"]
        for index in range(len(bodies)):
            got = crowd[index][1]
            while crowd[index][0] != 200:
                time.sleep(int(crowd[index][2]))
                crowd[index] = send(bodies[index])
                got = crowd[index][1]
            assert got["choices"] == alone[index]["choices"], index
        assert healthy(port)
    finally:
        process.kill()
        process.wait()


NEVER = 5
"""The token id the hostile client stops at, which its model never samples (lm-head bias -1e4)."""


@pytest.fixture(scope="module")
def long_context_teacher(tmp_path_factory, char_tokenizer):
    """A tiny Phi (its lm head has a bias) with a 2048-token context that never writes ``NEVER``."""
    from transformers import PhiConfig, PhiForCausalLM

    torch.manual_seed(0)
    config = PhiConfig(
        vocab_size=len(char_tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=2048,
        pad_token_id=0,
        eos_token_id=2,
        bos_token_id=None,
    )
    model = PhiForCausalLM(config)
    with torch.no_grad():
        model.lm_head.bias[NEVER] = -1e4
    path = tmp_path_factory.mktemp("phi") / "teacher"
    model.save_pretrained(path)
    char_tokenizer.save_pretrained(path)
    return path


def test_a_client_holding_the_longest_sample_allowed_does_not_hold_up_scoring(long_context_teacher):
    """The hostile client: the most tokens the server allows a request (8 prompts x
    2000 tokens = 16000 of the 16384 budget, each to the end of the context), never stopping
    (``ignore_eos``, a stop id the model never writes). While it decodes, scoring requests and a
    short sampling request are each answered within a second (measured here 0.01-0.03 s;
    alone a scoring request takes about 0.01 s): the decode hands the model over between steps."""
    port = free_port()
    process = start_opd_serve(long_context_teacher, port)
    try:
        hostile = sample_body(
            [[1, 6 + row, 7] for row in range(8)], 2045, ignore_eos=True, stop_token_ids=[NEVER]
        )
        with ThreadPoolExecutor(max_workers=1) as pool:
            held = pool.submit(post, port, hostile, "/v1/completions", 600)
            time.sleep(1.0)  # the hostile request is decoding
            waits = []
            for row in range(5):
                started = time.monotonic()
                status, _ = post(port, completion([[1, 5 + row, 6, 7] * 8]))
                waits.append(time.monotonic() - started)
                assert status == 200
            started = time.monotonic()
            assert post(port, sample_body([[1, 6]], 4, stop_token_ids=[2]))[0] == 200
            waits.append(time.monotonic() - started)
            assert not held.done(), (
                "the hostile request ended before the others were answered: no contention"
            )
            status, answer = held.result()
        print(f"waits while the hostile request decoded: {[round(w, 3) for w in waits]} s")
        assert status == 200
        assert [len(choice["token_ids"]) for choice in answer["choices"]] == [2045] * 8
        assert max(waits) < 1.0, waits
    finally:
        process.kill()
        process.wait()
