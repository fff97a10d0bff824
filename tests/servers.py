"""Real server processes for the tests: a free port, ``opd serve`` started and waited for."""

import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_until_up(
    port: int, process: subprocess.Popen, path: str = "/health", timeout_s: float = 60
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=1)
            return
        except urllib.error.HTTPError:
            return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError("server did not start")


def start_opd_serve(model_dir, port, *extra, wait: bool = True):
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "opd.cli",
            "serve",
            str(model_dir),
            "--port",
            str(port),
            "--served-model-name",
            "teacher",
            *extra,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    if wait:
        wait_until_up(port, process)
    return process


def through_server(config: dict, port: int, log_path) -> dict:
    """``config`` with its local teacher replaced by the same model behind ``opd serve`` on
    ``port``."""
    return dict(
        config,
        log_path=str(log_path),
        teacher={
            "model": "teacher",
            "backend": "openai",
            "base_url": f"http://127.0.0.1:{port}/v1",
            "tokenizer": config["teacher"]["model"],
        },
    )
