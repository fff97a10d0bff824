"""The settings of ``student.sampler: vllm_server`` (:mod:`opd.sampling.vllm_server`): the
rollout servers, how long to wait for them and how they are rested, checked when the config is
read."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field

from opd.sampling.base import PushedWeightsSettings


@dataclass
class VLLMServerSettings(PushedWeightsSettings):
    """``sampler: vllm_server``: vLLM servers started apart from the trainer, its weights pushed to
    them after every update."""

    rollout_servers: list[str] = field(default_factory=list)
    """``sampler: vllm_server``: the servers' base URLs (``http://host:port``), each serving the
    student; each process's rows are spread over them."""
    rollout_timeout_s: float = 300
    """``sampler: vllm_server``: the longest wait for one answer of a server (a rollout request, a
    weight push) before the run stops naming it."""
    rollout_weights_dir: str | None = None
    """``sampler: vllm_server``: where the pushed weights are written for the servers to read (a
    directory they see: a shared disk for servers on other machines), the one each server was
    started with (``opd rollout-server --weights-dir``) or one inside it; unset:
    ``/dev/shm/opd-rollout-weights`` (or ``opd-rollout-weights`` in the system's temporary
    directory), which is also the servers' default."""
    rollout_rest_s: float = 30
    """``sampler: vllm_server`` with several servers: how long a server taken out of rotation
    (unreachable, no answer in time, an HTTP 5xx, other weights) rests before the first weight
    push after it tries it again; 0 tries at every push."""
    rollout_api_key_env: str | None = None
    """``sampler: vllm_server``: the environment variable holding the servers' API key (their
    ``VLLM_API_KEY``), sent with every request; needed for servers that bind a non-loopback host."""

    def plan_line(self) -> str:
        """Where the rollouts are sampled, for the dry-run plan."""
        return f"vllm servers {', '.join(self.rollout_servers)}"

    def sampler_problems(self) -> Iterator[tuple[str, str]]:
        """``(field, problem)``: servers named, each reachable by URL, a sane timeout."""
        yield from PushedWeightsSettings.sampler_problems(self)
        if not self.rollout_servers:
            yield (
                "rollout_servers",
                "sampler: vllm_server needs at least one server URL (http://host:port)",
            )
            return
        for index, url in enumerate(self.rollout_servers):
            if not (isinstance(url, str) and re.fullmatch(r"https?://[^\s/]+(/\S*)?", url)):
                yield (
                    f"rollout_servers[{index}]",
                    f"{url!r} is not an http(s) URL such as http://127.0.0.1:8000",
                )
        if len(set(self.rollout_servers)) != len(self.rollout_servers):
            yield "rollout_servers", "a server is listed twice"
        if not self.rollout_timeout_s > 0:
            yield "rollout_timeout_s", f"must be above 0, got {self.rollout_timeout_s}"
        if not self.rollout_rest_s >= 0:
            yield "rollout_rest_s", f"must be 0 or above, got {self.rollout_rest_s}"
