"""One vLLM rollout server: the command that starts it with what opd needs (``opd
rollout-server``), and the HTTP client that checks it against the student
(:meth:`RolloutServer.handshake`) and drives its OpenAI and RL routes.
:mod:`opd.sampling.vllm_server` samples the student's rollouts on several of them.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from typing import Any

from opd.data.sequences import Completion
from opd.errors import ConfigError, RolloutServerError
from opd.policy.config import StudentConfig
from opd.sampling.rollout_guard import KEY_ENV, MIDDLEWARE, is_loopback

WEIGHT_BACKEND = "opd_safetensors"
"""The weight-transfer backend the servers must run (``opd.sampling.vllm_weight_files``)."""
SERVER_FLAGS = (
    "opd rollout-server STUDENT (or: VLLM_SERVER_DEV_MODE=1 python -m "
    "vllm.entrypoints.openai.api_server --model STUDENT --logprobs-mode processed_logprobs "
    "--generation-config vllm "
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
            f"opd rollout-server: give the key in the environment variable {KEY_ENV}, not "
            "--api-key (a command line shows in every user's process list); opd guards every "
            "route with it"
        )
    if not is_loopback(host) and not os.environ.get(KEY_ENV):
        raise ConfigError(
            f"opd rollout-server: --host {host} lets other machines reach the server's "
            f"weight-update routes; set an API key in the environment variable {KEY_ENV} first "
            "(the trainer sends it from the variable student.rollout_api_key_env names), or bind "
            "127.0.0.1"
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

    def call(
        self, method: str, path: str, body: dict | None = None, timeout_s: float | None = None
    ) -> Any:
        """The route's JSON answer; a refusal, a dead server or a slow one raises naming the
        server."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.url + path, data=data, method=method, headers=self.headers
        )
        limit = timeout_s or self.timeout_s
        try:
            with urllib.request.urlopen(request, timeout=limit) as response:
                text = response.read().decode()
        except urllib.error.HTTPError as error:
            detail = " ".join(error.read().decode(errors="replace").split())[:400]
            if error.code == 401:
                detail += (
                    " (the server wants its API key: set student.rollout_api_key_env to the name "
                    "of the environment variable that holds it)"
                )
            raise RolloutServerError(
                f"rollout server {self.url}: {method} {path} answered HTTP {error.code}: {detail}",
                fault="answer" if error.code >= 500 else None,
            ) from None
        except (urllib.error.URLError, OSError) as error:
            reason = getattr(error, "reason", error)
            if isinstance(reason, TimeoutError):
                raise RolloutServerError(
                    f"rollout server {self.url}: no answer to {method} {path} within {limit:g} s "
                    "(student.rollout_timeout_s); is it overloaded or stuck? Run the same command "
                    "again to resume once it answers",
                    fault="silent",
                ) from None
            raise RolloutServerError(
                f"rollout server {self.url}: cannot reach it ({reason}); start it (docs/vllm.md, "
                "rollout servers) or remove it from student.rollout_servers, then run the same "
                "command again to resume",
                fault="silent",
            ) from None
        try:
            return json.loads(text) if text else None
        except json.JSONDecodeError:
            raise RolloutServerError(
                f"rollout server {self.url}: {method} {path} answered what is not JSON: "
                f"{text[:200]!r}",
                fault="answer",
            ) from None

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
                f"--logprobs-mode is {model_config.get('logprobs_mode')} (its log-probs would not "
                "be those of the distribution it samples)"
            )
        if model_config.get("generation_config") != "vllm":
            problems.append(
                "--generation-config is not vllm (the checkpoint's sampling defaults apply)"
            )
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
                f"rollout server {self.url} serves '{self.model}', whose tokenizer is not the "
                f"student's ({student.model}): the probe text tokenizes to {ids['tokens'][:8]}... "
                f"there and {expected[:8]}... here"
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

    def complete(self, prompt: list[int], seed: int | None, body: dict, version: int) -> Completion:
        """One completion of ``prompt`` with its log-probs, tagged with the pushed ``version``
        (the caller checks before and after that the server still serves it)."""
        answer = self.call(
            "POST", "/v1/completions", body | {"model": self.model, "prompt": prompt, "seed": seed}
        )
        choice = answer["choices"][0]
        token_ids = list(choice["token_ids"])
        logprobs = [float(value) for value in choice["logprobs"]["token_logprobs"]]
        if len(logprobs) != len(token_ids):
            raise RolloutServerError(
                f"rollout server {self.url}: {len(token_ids)} tokens but {len(logprobs)} log-probs"
            )
        finished = choice["finish_reason"] == "stop"
        return Completion(token_ids, logprobs, finished=finished, policy_version=version)
