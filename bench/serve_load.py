"""``opd serve`` under concurrent clients: throughput, latency, peak memory, and whether every
answer is the one a lone client gets.

The server runs as its own process (``opd serve``, default limits but ``--max-connections``)
on SmolLM2-135M-Instruct (bench/smollm2.py). Each request is what a training step's client
sends: ``--sequences`` token sequences of ``--tokens`` ids with ``prompt_logprobs: --topk``.
Every distinct request is first answered with one client at a time (the reference); then, for
each concurrency level, that many client threads send ``--requests`` requests between them
(new connection each, as urllib does); past ``--max-connections`` they wait in the server's
queue. A request that fails to connect or gets a 5xx is retried after 50 ms, and counted.
An answer counts as wrong if its log-probs differ from the reference by more than 1e-4 (batch
composition inside the server never changes, so they should be equal); a request is lost if
it never gets a 200. Peak memory is the server process's VmHWM.

With ``--hostile SECONDS`` it measures fairness instead: one client asks for the most the
server allows a request (``--hostile-rows`` prompts, each sampled to the end of the context
with ``ignore_eos`` and a stop id it never reaches, within ``--max-tokens-per-request``); while
that decodes, one client sends scoring requests back to back for SECONDS, and their latency is
compared with the same requests' on the idle server.

With ``--sampling CLIENTS...`` it measures sampling throughput instead: each client sends one
seeded row a request (as opd's teacher client does), ``--sample-tokens`` tokens each, and the
server's completed rows per second at each number of clients are compared with one client's
(requests that wait while the model decodes are sampled together in one batch); every row's
tokens must equal the same request's alone.

    python bench/serve_load.py --out docs/results/serve_load.json
    python bench/serve_load.py --hostile 60 --out docs/results/serve_hostile.json
    python bench/serve_load.py --sampling 1 8 --out docs/results/serve_sampling.json
    python bench/serve_load.py --mixed 600 --out docs/results/serve_mixed.json

With ``--mixed SECONDS`` it runs a campaign of random interleavings instead: ``--clients``
threads each send, one after another for SECONDS, a request of a kind drawn at random: a
scoring request, a seeded sampling request, a malformed one (bad JSON, wrong types, an unknown
model, a negative length) or a slow one (its body trickled past ``--request-timeout``). The
server runs with a small ``--max-waiting``, so some requests are refused with 503. Each request
is counted as answered right (a score equal to its lone answer within 1e-4, a seeded sample
with its lone answer's tokens, a 4xx for a malformed one, the connection closed for a slow
one), refused (503 with ``Retry-After``, then sent again), wrong (a 200 with another answer, or
a status its kind should not get) or lost (no answer, a 5xx other than 503). The server's
resident memory is read every 5 s: its mean over the first and the last minute.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from provenance import write_result
from smollm2 import converted_dir

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.servers import free_port, wait_until_up


def post(port: int, body: bytes) -> tuple[int, dict | None, int]:
    """(status, answer, retries) of one request, retrying 503s and connection errors."""
    refused = 0
    while True:
        status, answer, _ = send_once(port, body)
        if status is not None and (status != 503 or refused > 2000):
            return status, answer, refused
        refused += 1
        time.sleep(0.05)


def logprobs_of(answer: dict) -> list[list[float]]:
    return [
        [
            next(iter(entry.values()))["logprob"] if entry else 0.0
            for entry in choice["prompt_logprobs"]
        ]
        for choice in answer["choices"]
    ]


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--concurrency", type=int, nargs="*", default=[1, 16, 64])
    parser.add_argument("--requests", type=int, default=128, help="requests per concurrency level")
    parser.add_argument("--distinct", type=int, default=32, help="distinct request bodies (cycled)")
    parser.add_argument("--sequences", type=int, default=2, help="sequences per request")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per sequence")
    parser.add_argument("--topk", type=int, default=0)
    parser.add_argument("--max-connections", type=int, default=32)
    parser.add_argument(
        "--hostile", type=float, help="seconds of scoring while a hostile client samples"
    )
    parser.add_argument(
        "--hostile-rows", type=int, default=2, help="prompts in the hostile request"
    )
    parser.add_argument("--sampling", type=int, nargs="*", help="sampling clients at each level")
    parser.add_argument("--sample-rows", type=int, default=32, help="rows sampled at each level")
    parser.add_argument("--sample-tokens", type=int, default=32, help="tokens sampled per row")
    parser.add_argument("--mixed", type=float, help="seconds of random interleavings of every kind")
    parser.add_argument("--clients", type=int, default=8, help="--mixed: client threads")
    parser.add_argument(
        "--out", type=Path, help="also write the results here as JSON, with their provenance"
    )
    args = parser.parse_args()
    limits = ["--max-waiting", "4", "--request-timeout", "2"] if args.mixed else []

    model = converted_dir()
    port = free_port()
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "opd",
            "serve",
            str(model),
            "--port",
            str(port),
            "--served-model-name",
            "teacher",
            "--max-connections",
            str(args.max_connections),
            *limits,
        ],
        stdout=subprocess.DEVNULL,
    )
    try:
        wait_until_up(port, server, timeout_s=300)
        rng = random.Random(0)
        bodies = [
            json.dumps(
                {
                    "model": "teacher",
                    "prompt": [
                        [rng.randrange(100, 49000) for _ in range(args.tokens)]
                        for _ in range(args.sequences)
                    ],
                    "prompt_logprobs": args.topk,
                    "max_tokens": 1,
                }
            ).encode()
            for _ in range(args.distinct)
        ]
        reference = []
        for body in bodies:
            status, answer, _ = post(port, body)
            assert status == 200, status
            reference.append(logprobs_of(answer))
        if args.sampling:
            results = sampling(port, args.sampling, args.sample_rows, args.sample_tokens)
            return
        if args.mixed:
            results = mixed(port, server.pid, bodies, reference, args.mixed, args.clients)
            results["server_alive"] = server.poll() is None
            print(json.dumps({k: v for k, v in results.items() if k != "memory_mib"}, indent=1))
            return
        if args.hostile:
            results = hostile(port, bodies, args.hostile, args.hostile_rows)
            results["server_peak_rss_mib"] = peak_rss_mib(server.pid)
            print(json.dumps(results))
            return
        idle_rss = peak_rss_mib(server.pid)
        levels = []
        for clients in args.concurrency:

            def one(index: int) -> dict:
                started = time.perf_counter()
                status, answer, refused = post(port, bodies[index % len(bodies)])
                seconds = time.perf_counter() - started
                wrong = status == 200 and any(
                    abs(a - b) > 1e-4
                    for got, want in zip(
                        logprobs_of(answer), reference[index % len(bodies)], strict=True
                    )
                    for a, b in zip(got, want, strict=True)
                )
                return {"status": status, "seconds": seconds, "refused": refused, "wrong": wrong}

            started = time.perf_counter()
            with ThreadPoolExecutor(max_workers=clients) as pool:
                outcomes = list(pool.map(one, range(args.requests)))
            wall = time.perf_counter() - started
            latencies = sorted(o["seconds"] for o in outcomes)
            level = {
                "clients": clients,
                "requests": len(outcomes),
                "answered_200": sum(o["status"] == 200 for o in outcomes),
                "lost": sum(o["status"] != 200 for o in outcomes),
                "wrong": sum(o["wrong"] for o in outcomes),
                "retried": sum(o["refused"] for o in outcomes),
                "requests_per_s": len(outcomes) / wall,
                "tokens_per_s": len(outcomes) * args.sequences * args.tokens / wall,
                "latency_p50_s": statistics.median(latencies),
                "latency_p99_s": latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
                "server_peak_rss_mib": peak_rss_mib(server.pid),
            }
            levels.append(level)
            print(json.dumps(level))
        print(
            f"server alive after the load: {server.poll() is None}; idle peak RSS {idle_rss:.0f} "
            "MiB"
        )
        results = {
            "levels": levels,
            "server_alive": server.poll() is None,
            "idle_peak_rss_mib": idle_rss,
        }
    finally:
        server.kill()
        server.wait()
        if "results" in locals():
            write_result(
                args.out, "bench/serve_load.py", vars(args) | {"model": str(model)}, results
            )


def sampling(port: int, levels: list[int], rows: int, tokens: int) -> dict:
    """Rows sampled per second by 1..N clients each sending one seeded row a request, against the
    first level's; every row's tokens against the same request sent alone."""

    def body(row: int) -> bytes:
        prompt = [1, 9690, 42 + row % 50]
        return json.dumps(
            {
                "model": "teacher",
                "prompt": prompt,
                "max_tokens": tokens,
                "temperature": 1.0,
                "seed": 1000 + row,
                "ignore_eos": True,
                "stop_token_ids": [49151],
            }
        ).encode()

    alone = [post(port, body(row))[1]["choices"][0]["token_ids"] for row in range(rows)]
    measured = []
    for clients in levels:
        started = time.perf_counter()
        with ThreadPoolExecutor(max_workers=clients) as pool:
            answers = list(pool.map(lambda row: post(port, body(row)), range(rows)))
        wall = time.perf_counter() - started
        level = {
            "clients": clients,
            "rows": rows,
            "answered_200": sum(status == 200 for status, _, _ in answers),
            "same_tokens_as_alone": sum(
                status == 200 and answer["choices"][0]["token_ids"] == want
                for (status, answer, _), want in zip(answers, alone, strict=True)
            ),
            "rows_per_s": rows / wall,
            "tokens_per_s": rows * tokens / wall,
        }
        measured.append(level)
        print(json.dumps(level))
    base = measured[0]["rows_per_s"]
    for level in measured:
        level["throughput_vs_first"] = level["rows_per_s"] / base
        print(
            f"{level['clients']} clients: {level['throughput_vs_first']:.2f}x the rows/s of "
            f"{levels[0]}"
        )
    return {"sampling": measured}


def latencies(port: int, bodies: list[bytes], seconds: float) -> list[float]:
    """Scoring requests sent one after another for ``seconds``: each one's latency."""
    waits: list[float] = []
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        started = time.perf_counter()
        status, _, _ = post(port, bodies[len(waits) % len(bodies)])
        assert status == 200, status
        waits.append(time.perf_counter() - started)
    return waits


def hostile(port: int, bodies: list[bytes], seconds: float, rows: int) -> dict:
    """Scoring latency on the idle server, then while one request samples the most it may."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=30) as response:
        context = json.loads(response.read())["data"][0]["max_model_len"]
    prompt = [1, 9690, 42]  # "<|im_start|>user" and a token: any short prompt
    max_tokens = min(context - len(prompt), 16384 // rows)
    body = json.dumps(
        {
            "model": "teacher",
            "prompt": [prompt] * rows,
            "max_tokens": max_tokens,
            "temperature": 1.0,
            "ignore_eos": True,
            "stop_token_ids": [49151],  # the last id of the vocabulary: not written in practice
        }
    ).encode()
    idle = latencies(port, bodies, min(seconds, 20))
    held = threading.Thread(
        target=post, args=(port, body), daemon=True
    )  # the server is killed under it
    held.start()
    time.sleep(2.0)  # the hostile request is past its prefill, decoding
    busy = latencies(port, bodies, seconds)
    still_decoding = held.is_alive()
    return {
        "hostile_request": {"rows": rows, "max_tokens": max_tokens, "context": context},
        "hostile_still_decoding_after": still_decoding,
        "idle": {"requests": len(idle), "p50_s": statistics.median(idle), "max_s": max(idle)},
        "during_hostile": {
            "requests": len(busy),
            "p50_s": statistics.median(busy),
            "max_s": max(busy),
        },
    }


def seeded_body(row: int, tokens: int = 16) -> bytes:
    """A seeded sampling request of one row (as opd's teacher client sends them)."""
    prompt = [1, 9690, 42 + row % 50]
    return json.dumps(
        {
            "model": "teacher",
            "prompt": prompt,
            "max_tokens": tokens,
            "temperature": 1.0,
            "seed": 1000 + row,
        }
    ).encode()


MALFORMED = [
    b"{not json",
    json.dumps({"model": "teacher", "prompt": 5, "max_tokens": 1}).encode(),
    json.dumps({"model": "someone-else", "prompt": [1, 2, 3], "max_tokens": 1}).encode(),
    json.dumps({"model": "teacher", "prompt": [1, 2, 3], "max_tokens": -1}).encode(),
    json.dumps({"model": "teacher", "prompt": [[1, 2], "x"], "max_tokens": 1}).encode(),
]


def send_once(port: int, body: bytes) -> tuple[int | None, dict | None, str | None]:
    """(status, JSON answer, Retry-After) of one request; status None: no answer."""
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=body,
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            return response.status, json.loads(response.read()), None
    except urllib.error.HTTPError as error:
        return error.code, None, error.headers.get("Retry-After")
    except OSError:
        return None, None, None


def slow_client(port: int, timeout_s: float = 2.0) -> bool:
    """A body trickled a byte a second: True when the server closes the connection in time."""
    import socket

    body = seeded_body(0)
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as connection:
        head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        connection.sendall(f"{head}Content-Length: {len(body)}\r\n\r\n".encode())
        try:
            for byte in body:
                connection.sendall(bytes([byte]))
                time.sleep(1.0)
                if time.monotonic() - started > 4 * timeout_s + 10:
                    return False  # still held open: the server did not drop it
        except OSError:
            return True  # dropped
        connection.settimeout(30)
        try:
            return (
                connection.recv(1) in (b"", b"H")
                and time.monotonic() - started < 4 * timeout_s + 10
            )
        except OSError:
            return True


def mixed(
    port: int, pid: int, bodies: list[bytes], reference: list, seconds: float, clients: int
) -> dict:
    """Random interleavings of scoring, seeded sampling, malformed and slow requests for
    ``seconds``."""
    alone = [send_once(port, seeded_body(row))[1]["choices"][0]["token_ids"] for row in range(8)]
    kinds = ("score", "sample", "malformed", "slow")
    counts = {
        kind: dict.fromkeys(("tried", "right", "refused", "wrong", "lost"), 0) for kind in kinds
    }
    lock, deadline = threading.Lock(), time.monotonic() + seconds
    memory: list[tuple[float, float]] = []

    def count(kind: str, outcome: str) -> None:
        with lock:
            counts[kind][outcome] += 1

    def one_request(rng: random.Random) -> None:
        kind = rng.choices(kinds, weights=(4, 4, 2, 1))[0]
        count(kind, "tried")
        if kind == "slow":
            count(kind, "right" if slow_client(port) else "lost")
            return
        index = rng.randrange(len(bodies) if kind == "score" else 8)
        body = {"score": bodies[index], "sample": seeded_body(index)}.get(kind) or rng.choice(
            MALFORMED
        )
        while True:
            status, answer, retry_after = send_once(port, body)
            if status not in (429, 503):
                break
            count(kind, "refused")
            if retry_after is None:
                count(kind, "wrong")  # a refusal must say when to come back
                return
            time.sleep(min(float(retry_after), 5.0))
        if kind == "malformed":
            count(kind, "right" if status is not None and 400 <= status < 500 else "wrong")
        elif status is None or status >= 500:
            count(kind, "lost")
        elif status != 200:
            count(kind, "wrong")
        elif kind == "score":
            near = all(
                abs(a - b) <= 1e-4
                for got, want in zip(logprobs_of(answer), reference[index], strict=True)
                for a, b in zip(got, want, strict=True)
            )
            count(kind, "right" if near else "wrong")
        else:
            count(kind, "right" if answer["choices"][0]["token_ids"] == alone[index] else "wrong")

    def client(number: int) -> None:
        rng = random.Random(number)
        while time.monotonic() < deadline:
            one_request(rng)

    def watch() -> None:
        started = time.monotonic()
        while time.monotonic() < deadline:
            fields = dict(
                line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
            )
            memory.append((time.monotonic() - started, int(fields["VmRSS"].split()[0]) / 1024))
            time.sleep(5)

    threads = [threading.Thread(target=client, args=(n,)) for n in range(clients)]
    threads.append(threading.Thread(target=watch))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    first = [mib for at, mib in memory if at < 60]
    last = [mib for at, mib in memory if at >= memory[-1][0] - 60]
    return {
        "seconds": seconds,
        "clients": clients,
        "counts": counts,
        "memory_first_minute_mib": statistics.mean(first),
        "memory_last_minute_mib": statistics.mean(last),
        "memory_mib": memory,
    }


if __name__ == "__main__":
    main()
