"""Torch's thread count: the user's when set; else one thread per core that no other process is
using, measured from the machine's CPU time (a real busy process beside the test)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest
import torch

from opd.threads import choose_threads, cores_busy_elsewhere, threads_for_idle_cores


@pytest.mark.parametrize(
    ("cores", "busy", "threads"),
    [(2, 0.0, 2), (2, 0.3, 2), (2, 1.0, 1), (2, 2.2, 1), (8, 3.4, 5), (8, 0.6, 7), (1, 0.0, 1)],
)
def test_one_thread_per_idle_core_and_at_least_one(cores, busy, threads):
    assert threads_for_idle_cores(cores, busy) == threads


def test_a_users_setting_is_kept(monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setattr(
        torch, "set_num_threads", lambda n: pytest.fail("the user's setting was overridden")
    )
    assert choose_threads() is None
    assert torch.get_num_threads() == before


def test_a_busy_process_is_seen_and_this_ones_own_work_is_not():
    quiet = cores_busy_elsewhere(0.5)
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        beside = cores_busy_elsewhere(0.5)
    finally:
        spinner.kill()
        spinner.wait()
    assert 0.6 < beside - quiet < 1.4, (quiet, beside)

    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            pass

    worker = threading.Thread(target=spin)
    worker.start()
    try:
        own = cores_busy_elsewhere(0.5)
    finally:
        stop.set()
        worker.join()
    assert own - quiet < 0.4, (quiet, own)
