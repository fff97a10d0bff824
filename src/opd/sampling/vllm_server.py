"""The student's rollouts sampled by vLLM servers in other processes (or on other machines), the
trainer's weights pushed to them after every update through vLLM's own weight-update routes.

A server is a stock vLLM OpenAI server started with the RL routes and opd's file backend::

    VLLM_SERVER_DEV_MODE=1 python -m vllm.entrypoints.openai.api_server --model STUDENT \\
        --logprobs-mode processed_logprobs --generation-config vllm \\
        --weight-transfer-config '{"backend": "opd_safetensors"}'

Before training, every server is checked against the student (:meth:`RolloutServer.handshake`):
the served architecture and vocabulary, the settings that make its log-probs the behaviour
policy's, and the weight backend. A push writes the student's sampler weights (LoRA merged;
gathered from FSDP shards a bucket at a time, one file a bucket) where the servers can read them,
then drives ``/start_weight_update``, ``/update_weights`` and ``/finish_weight_update`` with a
version tag unique to the run and the policy version, and resets each server's prefix cache.
Every rollout checks that each server it used still serves that tag before and after sampling,
so no batch comes from weights other than the recorded ones (a server restarted, or a push that
failed half way, tagged ``-loading`` until it completes, is refused). Rows go to the servers round
robin, one request a row with its own seed, so a row draws the same tokens whichever server
samples it. ``opd rollout-server`` starts vLLM's server with the options this needs.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import urllib.error
import urllib.request
import uuid
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from safetensors.torch import save_file

from opd.data.sequences import Completion
from opd.distributed import broadcast_object, new_group, world
from opd.errors import ConfigError, RolloutServerError
from opd.models import DTYPES
from opd.policy.config import StudentConfig
from opd.sampling.base import SamplingParams, neutral_sampling_body, pad_id_for, row_seeds
from opd.sampling.rollout_guard import KEY_ENV, MIDDLEWARE, default_weights_root, is_loopback

if TYPE_CHECKING:
    from opd.policy.policy import Policy

WEIGHT_BACKEND = "opd_safetensors"
"""The weight-transfer backend the servers must run (``opd.sampling.vllm_weight_files``)."""
SERVER_FLAGS = (
    "opd rollout-server STUDENT (or: VLLM_SERVER_DEV_MODE=1 python -m vllm.entrypoints.openai.api_server "
    "--model STUDENT --logprobs-mode processed_logprobs --generation-config vllm "
    f'--weight-transfer-config \'{{"backend": "{WEIGHT_BACKEND}"}}\')'
)
SERVER_OPTIONS = {
    "--logprobs-mode": "processed_logprobs",
    "--generation-config": "vllm",
    "--weight-transfer-config": json.dumps({"backend": WEIGHT_BACKEND}),
}
"""The vLLM server options a rollout server needs (``opd rollout-server`` sets them)."""


def rollout_server_command(model: str, host: str, port: int, vllm_args: list[str]) -> list[str]:
    """vLLM's OpenAI server started as a rollout server: the options it needs, loopback unless
    ``host`` says otherwise, opd's key check on every route, and the user's own vLLM options; one
    that contradicts a needed option is refused naming it, and so is a host other machines reach
    while ``VLLM_API_KEY`` is unset (its weight-update routes would load weights from anyone)."""
    given = {arg.split("=", 1)[0] for arg in vllm_args if arg.startswith("--")}
    if "--api-key" in given:
        raise ConfigError(
            f"opd rollout-server: give the key in the environment variable {KEY_ENV}, not --api-key "
            "(a command line shows in every user's process list); opd guards every route with it"
        )
    if not is_loopback(host) and not os.environ.get(KEY_ENV):
        raise ConfigError(
            f"opd rollout-server: --host {host} lets other machines reach the server's weight-update "
            f"routes; set an API key in the environment variable {KEY_ENV} first (the trainer sends "
            "it from the variable student.rollout_api_key_env names), or bind 127.0.0.1"
        )
    if clashes := sorted(given & {*SERVER_OPTIONS, "--model", "--host", "--port"}):
        flag = clashes[0]
        why = (
            f"to {SERVER_OPTIONS[flag]} (the trainer refuses a server without it)"
            if flag in SERVER_OPTIONS
            else "from MODEL, --host and --port, opd rollout-server's own arguments"
        )
        raise ConfigError(f"opd rollout-server: {flag} is set by opd {why}")
    command = ["-m", "vllm.entrypoints.openai.api_server", "--model", model]
    command += ["--host", host, "--port", str(port)]
    for flag, value in SERVER_OPTIONS.items():
        command += [flag, value]
    return [*command, "--middleware", MIDDLEWARE, *vllm_args]


PROBE = "Distillation probe: 12 + 30 = 42. Ünïcödé ✓"
"""Text whose token ids must be the same on the server as in the student's tokenizer."""


class RolloutServer:
    """One vLLM server, spoken to over HTTP with the JSON bodies of its OpenAI and RL routes."""

    def __init__(self, url: str, timeout_s: float, api_key: str | None = None):
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.model = ""
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"

    def call(self, method: str, path: str, body: dict | None = None, timeout_s: float | None = None) -> Any:
        """The route's JSON answer; a refusal, a dead server or a slow one raises naming the server."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, method=method, headers=self.headers)
        limit = timeout_s or self.timeout_s
        try:
            with urllib.request.urlopen(request, timeout=limit) as response:
                text = response.read().decode()
        except urllib.error.HTTPError as error:
            detail = " ".join(error.read().decode(errors="replace").split())[:400]
            if error.code == 401:
                detail += (
                    " (the server wants its API key: set student.rollout_api_key_env to the name of "
                    "the environment variable that holds it)"
                )
            raise RolloutServerError(
                f"rollout server {self.url}: {method} {path} answered HTTP {error.code}: {detail}"
            ) from None
        except (urllib.error.URLError, OSError) as error:
            reason = getattr(error, "reason", error)
            if isinstance(reason, TimeoutError):
                raise RolloutServerError(
                    f"rollout server {self.url}: no answer to {method} {path} within {limit:g} s "
                    "(student.rollout_timeout_s); is it overloaded or stuck? Run the same command "
                    "again to resume once it answers"
                ) from None
            raise RolloutServerError(
                f"rollout server {self.url}: cannot reach it ({reason}); start it (docs/vllm.md, "
                "rollout servers) or remove it from student.rollout_servers, then run the same "
                "command again to resume"
            ) from None
        return json.loads(text) if text else None

    def handshake(self, student: StudentConfig, tokenizer) -> None:
        """Refuse a server that would not sample the student as the trainer scores it."""
        models = self.call("GET", "/v1/models")["data"]
        self.model = models[0]["id"]
        try:
            info = self.call("GET", "/server_info?config_format=json")
        except RolloutServerError as error:
            if "HTTP 404" not in str(error):
                raise
            raise RolloutServerError(
                f"rollout server {self.url} has no RL routes; start it as: {SERVER_FLAGS}"
            ) from None
        config = info["vllm_config"]
        model_config = config["model_config"]
        problems = []
        if model_config.get("logprobs_mode") != "processed_logprobs":
            problems.append(
                f"--logprobs-mode is {model_config.get('logprobs_mode')} (its log-probs would not be "
                "those of the distribution it samples)"
            )
        if model_config.get("generation_config") != "vllm":
            problems.append("--generation-config is not vllm (the checkpoint's sampling defaults apply)")
        backend = (config.get("weight_transfer_config") or {}).get("backend")
        if backend != WEIGHT_BACKEND:
            problems.append(f"its weight-transfer backend is {backend!r}, not {WEIGHT_BACKEND!r}")
        if problems:
            raise RolloutServerError(
                f"rollout server {self.url}: {'; '.join(problems)}; start it as: {SERVER_FLAGS}"
            )
        probe = {"model": self.model, "prompt": PROBE, "add_special_tokens": False}
        ids = self.call("POST", "/tokenize", probe)
        expected = tokenizer(PROBE, add_special_tokens=False)["input_ids"]
        if ids["tokens"] != expected:
            raise RolloutServerError(
                f"rollout server {self.url} serves '{self.model}', whose tokenizer is not the student's "
                f"({student.model}): the probe text tokenizes to {ids['tokens'][:8]}... there and "
                f"{expected[:8]}... here"
            )
        self.call("POST", "/init_weight_transfer_engine", {"init_info": {}})

    def begin_weight_update(self, loading_tag: str) -> None:
        """``/start_weight_update``, the server first tagged ``loading_tag`` so that a push failing
        half way leaves no tag any run accepts; an update a killed trainer left open is closed
        first (the whole set of weights follows, so what it had loaded is overwritten)."""
        self.call("POST", "/update_weight_version", {"new_version": loading_tag})
        try:
            self.call("POST", "/start_weight_update", {})
        except RolloutServerError as error:
            if "already active" not in str(error):
                raise
            self.call("POST", "/finish_weight_update", {"weight_version": "opd-interrupted-update"})
            self.call("POST", "/start_weight_update", {})

    def served_version(self) -> str | None:
        return self.call("GET", "/weight_info")["weight_version"]


class VLLMServerEngine:
    """Samples the student's rollouts on ``student.rollout_servers``; :meth:`sync` pushes weights.

    Rank 0 alone pushes (the weights are gathered by every process, a collective, and written by
    rank 0); every process then samples its own rows on the servers. The coordination runs on a
    process group of its own, so a worker thread collecting ahead may push while the main thread
    trains.
    """

    serves_evaluation = True

    def __init__(
        self,
        student: StudentConfig,
        policy: Policy,
        tokenizer,
        *,
        stop_token_ids: list[int],
        stop_strings: list[str] | None = None,
    ):
        self.policy = policy
        self.stop_token_ids = list(stop_token_ids)
        self.stop_strings = list(stop_strings or [])
        self.pad_id = pad_id_for(tokenizer, stop_token_ids)
        self.vocab_size = len(tokenizer)
        embedding = getattr(policy.base_model.config, "vocab_size", self.vocab_size)
        # a checkpoint's embedding padded past the tokenizer: never sample (or normalise over) the padding
        self.allowed_token_ids = list(range(self.vocab_size)) if embedding > self.vocab_size else None
        self.dtype = DTYPES.get(student.sampling_dtype, policy.dtype)
        self.bucket_bytes = int(student.sync_bucket_mb * 2**20)
        key = None
        if student.rollout_api_key_env:
            key = os.environ.get(student.rollout_api_key_env)
            if not key:
                raise ConfigError(
                    f"student.rollout_api_key_env: the environment variable "
                    f"{student.rollout_api_key_env} is not set or empty"
                )
        self.servers = [RolloutServer(url, student.rollout_timeout_s, key) for url in student.rollout_servers]
        self.processes = world()
        self.group = new_group() if self.processes.size > 1 else None
        self.run_tag = broadcast_object(uuid.uuid4().hex[:12])
        self.version: int | None = None
        self.weights_dir: Path | None = None
        if self.processes.is_main:
            root = Path(student.rollout_weights_dir or default_weights_root())
            root.mkdir(mode=0o700, parents=True, exist_ok=True)
            self.weights_dir = Path(tempfile.mkdtemp(prefix="push-", dir=root))
            weakref.finalize(self, shutil.rmtree, self.weights_dir, True)
        failure = None
        if self.processes.is_main:
            try:
                for server in self.servers:
                    server.handshake(student, tokenizer)
            except RolloutServerError as error:
                failure = str(error)
        failure = broadcast_object(failure)
        if failure:
            raise ConfigError(f"student.rollout_servers: {failure}")
        models = broadcast_object([server.model for server in self.servers])
        for server, model in zip(self.servers, models, strict=True):
            server.model = model

    def tag(self, version: int) -> str:
        """The weight version a server serves after the push of policy version ``version``."""
        return f"opd-{self.run_tag}-v{version}"

    def sync(self, source) -> None:
        """Push ``source``'s weights (the policy, or weights published for collection ahead) to every
        server if their version is not the one pushed last."""
        if self.version == source.version:
            return
        weights = (
            self.policy.streamed_sampler_weights(self.dtype, self.bucket_bytes)
            if source is self.policy
            else source.sampler_weights(self.dtype)
        )
        failure = None
        if self.processes.is_main:
            try:
                self._push(weights, source.version)
            except RolloutServerError as error:
                failure = str(error)
        elif source is self.policy and self.policy.sharded:
            for _ in weights:  # the gather is a collective: take part, rank 0 writes
                pass
        failure = broadcast_object(failure, self.group)
        if failure:
            raise RolloutServerError(f"{failure}; no batch was sampled from these weights")
        self.version = source.version

    def _push(self, weights, version: int) -> None:
        directory = self.weights_dir / f"v{version}"
        directory.mkdir()
        files, bucket, size = [], {}, 0

        def flush() -> None:
            nonlocal bucket, size
            if bucket:
                path = directory / f"part-{len(files):05d}.safetensors"
                save_file({name: tensor.contiguous() for name, tensor in bucket.items()}, str(path))
                files.append(str(path))
                bucket, size = {}, 0

        for name, tensor in weights:
            bucket[name] = tensor.detach().to("cpu")
            size += tensor.numel() * tensor.element_size()
            if size >= self.bucket_bytes:
                flush()
        flush()
        try:
            for server in self.servers:
                server.begin_weight_update(f"{self.tag(version)}-loading")
                server.call("POST", "/update_weights", {"update_info": {"files": files}})
                server.call("POST", "/finish_weight_update", {"weight_version": self.tag(version)})
                server.call("POST", "/reset_prefix_cache", {})
        finally:
            shutil.rmtree(directory, ignore_errors=True)

    def rollout(
        self, prompts: list[list[int]], params: SamplingParams, *, seeds: list[int]
    ) -> list[Completion]:
        """One completion per prompt from the pushed weights, each recording their policy version."""
        return self.sample(
            prompts,
            temperature=params.temperature,
            max_tokens=params.max_tokens,
            greedy=params.greedy,
            seed=seeds,
        )

    def sample(
        self,
        prompts: list[list[int]],
        *,
        temperature: float,
        max_tokens: int,
        greedy: bool = False,
        seed: int | list[int] | None = None,
    ) -> list[Completion]:
        """One completion per prompt, row ``i`` on server ``i mod servers`` (offset by rank)."""
        if self.version is None:
            raise RuntimeError("VLLMServerEngine.sample before the first sync: call sync(policy) first")
        seeds = [None] * len(prompts) if seed is None else row_seeds(seed, len(prompts))
        chosen = [self.servers[(self.processes.rank + i) % len(self.servers)] for i in range(len(prompts))]
        used = list({id(s): s for s in chosen}.values())
        self._check_versions(used)
        temperature = 0.0 if greedy else temperature
        body = neutral_sampling_body(max_tokens, temperature, self.stop_token_ids, self.stop_strings)
        body["allowed_token_ids"] = self.allowed_token_ids

        def one(row: int) -> Completion:
            server = chosen[row]
            answer = server.call(
                "POST",
                "/v1/completions",
                body | {"model": server.model, "prompt": prompts[row], "seed": seeds[row]},
            )
            choice = answer["choices"][0]
            token_ids = list(choice["token_ids"])
            logprobs = [float(value) for value in choice["logprobs"]["token_logprobs"]]
            if len(logprobs) != len(token_ids):
                raise RolloutServerError(
                    f"rollout server {server.url}: {len(token_ids)} tokens but {len(logprobs)} log-probs"
                )
            finished = choice["finish_reason"] == "stop"
            return Completion(token_ids, logprobs, finished=finished, policy_version=self.version)

        with ThreadPoolExecutor(max_workers=min(32, max(1, len(prompts)))) as pool:
            completions = list(pool.map(one, range(len(prompts))))
        self._check_versions(used)
        return completions

    def _check_versions(self, servers: list[RolloutServer]) -> None:
        expected = self.tag(self.version)
        for server in servers:
            served = server.served_version()
            if served != expected:
                raise RolloutServerError(
                    f"rollout server {server.url} serves weight version {served!r}, not this run's "
                    f"{expected!r}: it was restarted or another run pushed to it; give each run its own "
                    "servers, then run the same command again to resume"
                )
