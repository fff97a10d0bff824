"""Faults injected on purpose into real ``opd train`` processes: SIGTERM / Ctrl-C, SIGKILL at random
points, a disk that fills during a checkpoint, the log directory removed mid-run, and teacher
servers that fail, answer late or out of order.

The promise each test holds the run to: it stops (or carries on) as documented, with one clear
line and no traceback, and running the same command again ends with exactly the metrics and
weights of a run that was never disturbed: no step lost, none done twice.
"""

from __future__ import annotations

import contextlib
import os
import random
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
import yaml
from safetensors.torch import load_file

from opd.config import config_from_dict
from opd.runs.checkpoints import list_checkpoints
from opd.runs.metrics import read_jsonl
from opd.trainer.loop import train
from tests.servers import free_port, wait_until_up
from tests.test_resume import assert_same_rows

STEPS = 6
HERE = Path(__file__).parent


def write_config(base_config: dict, path: Path, log_path: Path, **top) -> Path:
    config = dict(base_config, log_path=str(log_path), **top)
    config["training"] = dict(base_config["training"], max_steps=STEPS, learning_rate=1e-2)
    path.write_text(yaml.safe_dump(config))
    return path


def reference_run(config_path: Path, tmp_path: Path):
    """The same config trained undisturbed, in this process: its metrics and final weights."""
    config = yaml.safe_load(config_path.read_text())
    config["log_path"] = str(tmp_path / "reference")
    train(config_from_dict(config), progress=False)
    return read_jsonl(tmp_path / "reference" / "metrics.jsonl"), final_weights(
        tmp_path / "reference"
    )


def final_weights(log_path: Path) -> dict[str, torch.Tensor]:
    return load_file(list_checkpoints(log_path)[-1].path / "model" / "model.safetensors")


def start(config_path: Path, **options) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "opd", "train", str(config_path), "--no-progress"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        **options,
    )


def rows_written(log_path: Path) -> int:
    metrics = log_path / "metrics.jsonl"
    return len(metrics.read_text().splitlines()) if metrics.exists() else 0


def wait_for_rows(
    process: subprocess.Popen, log_path: Path, rows: int, timeout_s: float = 120
) -> None:
    deadline = time.monotonic() + timeout_s
    while rows_written(log_path) < rows:
        assert process.poll() is None, process.stderr.read()
        assert time.monotonic() < deadline, "the run made no progress"
        time.sleep(0.005)


def finish(config_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "opd", "train", str(config_path), "--no-progress"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr


def assert_undisturbed(log_path: Path, reference) -> None:
    rows, weights = reference
    assert_same_rows(read_jsonl(log_path / "metrics.jsonl"), rows)
    got = final_weights(log_path)
    assert got.keys() == weights.keys()
    for name, tensor in weights.items():
        torch.testing.assert_close(got[name], tensor, atol=1e-6, rtol=0)


def disturbed(base_config: dict, tmp_path: Path, disturb) -> tuple[Path, Path, object, int, str]:
    """A run (no periodic checkpoints) disturbed by ``disturb(process, log_path)`` after 2 steps:
    its log path, config, the undisturbed reference, and its exit status and stderr."""
    log_path = tmp_path / "run"
    config_path = write_config(base_config, tmp_path / "run.yaml", log_path, save_every=0)
    reference = reference_run(config_path, tmp_path)
    process = start(config_path)
    wait_for_rows(process, log_path, 2)
    disturb(process, log_path)
    _, stderr = process.communicate(timeout=120)
    assert "Traceback" not in stderr
    return log_path, config_path, reference, process.returncode, stderr


def test_sigterm_finishes_the_step_checkpoints_it_and_says_where_the_run_resumes(
    base_config, tmp_path
):
    """A scheduler's SIGTERM (Ctrl-C's SIGINT takes the same path: its first one is checked by
    the second-Ctrl-C test below)."""
    log_path, config_path, reference, status, stderr = disturbed(
        base_config, tmp_path, lambda process, _: process.send_signal(signal.SIGTERM)
    )
    assert status == 128 + signal.SIGTERM, stderr
    done = rows_written(log_path)
    assert "SIGTERM received: finishing the current step" in stderr
    assert f"stopped by SIGTERM after step {done} of {STEPS}" in stderr
    assert f"Run the same command again to resume from step {done}" in stderr
    assert 2 <= done < STEPS
    assert [r.step for r in list_checkpoints(log_path)] == [done]  # save_every 0: the signal's own
    finish(config_path)
    assert_undisturbed(log_path, reference)


def test_sigkill_at_random_points_over_many_runs_loses_and_repeats_nothing(base_config, tmp_path):
    """Killed at random moments (sampling, update, metrics write, checkpoint write), run after
    run."""
    log_path = tmp_path / "run"
    config_path = write_config(base_config, tmp_path / "run.yaml", log_path, save_every=1)
    reference = reference_run(config_path, tmp_path)
    chance = random.Random(1234)
    kills = 0
    while kills < 4:
        process = start(config_path)
        rows_before = rows_written(log_path)
        wait_for_rows(process, log_path, min(rows_before + 1, STEPS))
        time.sleep(
            chance.uniform(0.0, 0.4)
        )  # a step here takes about a tenth of a second to a second
        if process.poll() is not None:
            break  # it finished first: the remaining kills would land nowhere
        process.kill()
        process.wait()
        kills += 1
    assert kills >= 2, "the runs finished before they could be killed"
    finish(config_path)
    assert_undisturbed(log_path, reference)
    assert not list((log_path / "checkpoints").glob(".tmp-*"))  # half-written saves cleaned up


@contextlib.contextmanager
def small_disk(path: Path, size_kib: int):
    """A tmpfs of ``size_kib`` at ``path`` (needs root); yields a function that enlarges it."""
    path.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", str(path)]
    )
    if mounted.returncode:
        yield None
        return
    try:
        yield lambda kib: subprocess.run(
            ["mount", "-o", f"remount,size={kib}k", str(path)], check=True
        )
    finally:
        subprocess.run(["umount", "-l", str(path)])


def test_a_disk_that_fills_during_a_checkpoint_stops_the_run_clearly_and_a_rerun_resumes(
    base_config, tmp_path
):
    """On a small tmpfs (as root) the fourth checkpoint does not fit; elsewhere a per-file size
    limit (RLIMIT_FSIZE, any user) makes the first one fail. Either way the same promises hold."""
    with small_disk(tmp_path / "disk", 1200) as enlarge:
        log_path = tmp_path / "disk" / "run"
        config_path = write_config(base_config, tmp_path / "run.yaml", log_path, save_every=1)
        reference = reference_run(config_path, tmp_path)
        if enlarge is None:
            limit = (
                150 * 1024
            )  # the weights (about 100 KB) fit, the optimizer state (about 220 KB) does not

            def limited() -> None:
                signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of being killed
                resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

            process = start(config_path, preexec_fn=limited)
        else:
            process = start(config_path)
        _, stderr = process.communicate(timeout=300)
        assert process.returncode == 2, stderr
        assert "Traceback" not in stderr
        assert f"opd: error: {log_path}: no space left for the run's files" in stderr
        assert "run the same command again to resume" in stderr
        kept = [r.step for r in list_checkpoints(log_path)]
        assert kept == ([] if enlarge is None else [1, 2, 3])
        assert (
            f"the last complete checkpoint is step {kept[-1]}" in stderr
            if kept
            else "no checkpoint" in stderr
        )
        assert not list(
            (log_path / "checkpoints").glob(".tmp-*")
        )  # the failed save took its space back
        if enlarge is not None:
            enlarge(20 * 1024)
        finish(config_path)
        assert_undisturbed(log_path, reference)


def test_the_log_directory_removed_mid_run_stops_it_with_a_clear_error(base_config, tmp_path):
    log_path, config_path, reference, status, stderr = disturbed(
        base_config, tmp_path, lambda _, log_path: shutil.rmtree(log_path)
    )
    assert status == 2, stderr
    assert f"opd: error: {log_path}: the run's directory (or its config.yaml) was removed" in stderr
    finish(config_path)  # starts over: nothing of the first attempt survived
    assert_undisturbed(log_path, reference)


def fault_server(mode: str) -> tuple[int, subprocess.Popen]:
    port = free_port()
    process = subprocess.Popen([sys.executable, str(HERE / "fault_server.py"), mode, str(port)])
    wait_until_up(port, process, "/")
    return port, process


def remote_config(base_config: dict, tmp_path: Path, port: int, name: str) -> dict:
    config = dict(
        base_config,
        log_path=str(tmp_path / name),
        teacher={
            "model": "t",
            "backend": "openai",
            "base_url": f"http://127.0.0.1:{port}/v1",
            "tokenizer": base_config["teacher"]["model"],
            "timeout_s": 1.0,
            "max_retries": 3,
            "request_batch_size": 2,
        },
    )
    config["training"] = dict(base_config["training"], max_steps=3)
    return config


def test_flaky_late_and_reordered_teachers_cost_retries_not_the_run(base_config, tmp_path):
    port, honest = fault_server("ok")
    try:
        expected = train(
            config_from_dict(remote_config(base_config, tmp_path, port, "ok")), progress=False
        )
    finally:
        honest.kill()
        honest.wait()
    for mode in ("flaky", "late", "reorder"):
        port, server = fault_server(mode)
        try:
            got = train(
                config_from_dict(remote_config(base_config, tmp_path, port, mode)), progress=False
            )
        finally:
            server.kill()
            server.wait()
        assert_same_rows(got.metrics, expected.metrics)


def test_a_teacher_answering_nan_stops_the_run_before_any_update(base_config, tmp_path):
    port, server = fault_server("nan")
    try:
        config = remote_config(base_config, tmp_path, port, "nan")
        path = tmp_path / "nan.yaml"
        path.write_text(yaml.safe_dump(config))
        result = subprocess.run(
            [sys.executable, "-m", "opd", "train", str(path), "--no-progress"],
            capture_output=True,
            text=True,
            timeout=300,
            env=os.environ,
        )
    finally:
        server.kill()
        server.wait()
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "is not a finite number" in result.stderr
    assert read_jsonl(tmp_path / "nan" / "metrics.jsonl") == []  # no step was applied
    assert list_checkpoints(tmp_path / "nan") == []


def test_a_second_ctrl_c_stops_at_once_and_says_how_to_resume(base_config, tmp_path):
    """Ctrl-C while the teacher takes 5 s to answer, then Ctrl-C again: no waiting for the step."""
    port, server = fault_server("slow")
    try:
        config = remote_config(base_config, tmp_path, port, "run")
        config["teacher"] |= {"timeout_s": 30.0, "replica_probes": 0}  # probes would wait 4 x 5 s
        path = tmp_path / "run.yaml"
        path.write_text(yaml.safe_dump(config))
        process = start(path)
        spans = tmp_path / "run" / "timing.jsonl"
        deadline = time.monotonic() + 120
        while not (spans.exists() and '"sample"' in spans.read_text()):  # sampled: now the teacher
            assert time.monotonic() < deadline and process.poll() is None
            time.sleep(0.01)
        process.send_signal(signal.SIGINT)
        time.sleep(1.5)
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=60)
    finally:
        server.kill()
        server.wait()
    assert process.returncode == 130, stderr
    assert "SIGINT received: finishing the current step" in stderr
    assert (
        "opd: interrupted. Run the same command again to resume from the last checkpoint." in stderr
    )
    assert "Traceback" not in stderr
    assert list_checkpoints(tmp_path / "run") == []
