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

import os
import shutil
import tempfile
import uuid
import weakref
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from safetensors.torch import save_file

from opd.data.sequences import Completion
from opd.distributed import broadcast_object, new_group, world
from opd.errors import ConfigError, RolloutServerError
from opd.models import DTYPES
from opd.sampling.base import (
    SamplingParams,
    TurnStream,
    neutral_sampling_body,
    pad_id_for,
    row_seeds,
)
from opd.sampling.rollout_guard import default_weights_root
from opd.sampling.rollout_server import RolloutServer
from opd.sampling.server_pool import ServerPool
from opd.sampling.vllm_server_settings import VLLMServerSettings

if TYPE_CHECKING:
    from opd.policy.policy import Policy


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
        student: VLLMServerSettings,
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
        # a checkpoint's embedding padded past the tokenizer: never sample (or normalise over) the
        # padding
        self.allowed_token_ids = (
            list(range(self.vocab_size)) if embedding > self.vocab_size else None
        )
        self.dtype = DTYPES.get(student.sampling_dtype, policy.dtype)
        self.bucket_bytes = int(student.sync_bucket_mb * 2**20)
        key = None
        if student.rollout_api_key_env:
            key = os.environ.get(student.rollout_api_key_env)
            if not key:
                raise ConfigError(
                    "student.rollout_api_key_env: the environment variable "
                    f"{student.rollout_api_key_env} is not set or empty"
                )
        self.servers = [
            RolloutServer(url, student.rollout_timeout_s, key) for url in student.rollout_servers
        ]
        self.processes = world()
        self.pool = ServerPool(self.servers, student.rollout_rest_s, rank=self.processes.rank)
        self.student, self.tokenizer = student, tokenizer
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
        """Push ``source``'s weights (the policy, or weights published for collection ahead) to
        every server if their version is not the one pushed last."""
        if self.version == source.version:
            return
        weights = (
            self.policy.streamed_sampler_weights(self.dtype, self.bucket_bytes)
            if source is self.policy
            else source.sampler_weights(self.dtype)
        )
        failure, live = None, None
        if self.processes.is_main:
            try:
                self._push(weights, source.version)
            except RolloutServerError as error:
                failure = str(error)
            live = [(server.url, server.model) for server in self.pool.live()]
        elif source is self.policy and self.policy.sharded:
            for _ in weights:  # the gather is a collective: take part, rank 0 writes
                pass
        failure, live = broadcast_object((failure, live), self.group)
        if failure:
            raise RolloutServerError(f"{failure}; no batch was sampled from these weights")
        models = dict(live)
        for server in self.servers:
            server.model = models.get(server.url, server.model)
        self.pool.keep(list(models))
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
        try:  # servers back from their rest first: they may be all a failing push leaves
            rejoined = {s.url for s in self.pool.resting() if self._rejoin(s, files, version)}
            for server in self.pool.live():
                if server.url in rejoined:
                    continue
                try:
                    self._push_files(server, files, version)
                except RolloutServerError as error:
                    if error.fault != "silent":  # it answered: the update itself failed
                        raise
                    self.pool.take_out(server, error)
        finally:
            shutil.rmtree(directory, ignore_errors=True)

    def _push_files(self, server: RolloutServer, files: list[str], version: int) -> None:
        server.begin_weight_update(f"{self.tag(version)}-loading")
        server.call("POST", "/update_weights", {"update_info": {"files": files}})
        server.call("POST", "/finish_weight_update", {"weight_version": self.tag(version)})
        server.call("POST", "/reset_prefix_cache", {})

    def _rejoin(self, server: RolloutServer, files: list[str], version: int) -> bool:
        """A server out of rotation, tried again: checked as at the start, sent the current
        weights and taken back once it serves their tag; else it rests again (said unless it is
        still unreachable)."""
        try:
            server.handshake(self.student, self.tokenizer)
            self._push_files(server, files, version)
            served = server.served_version()
        except RolloutServerError as error:
            if error.fault != "silent":
                self.pool.warn(
                    f"rollout server {server.url} answers again but is kept out: {error}"
                )
            return False
        if served != self.tag(version):
            return False
        self.pool.take_back(server, served)
        return True

    def rollout(
        self, prompts: list[list[int]], params: SamplingParams, *, seeds: list[int]
    ) -> list[Completion]:
        """One completion per prompt from the pushed weights, each recording their policy
        version."""
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
            raise RuntimeError(
                "VLLMServerEngine.sample before the first sync: call sync(policy) first"
            )
        seeds = [None] * len(prompts) if seed is None else row_seeds(seed, len(prompts))
        body = self._body(temperature, max_tokens, greedy)
        self.pool.verify(self.pool.live(), self.tag(self.version))
        done: dict[int, tuple[RolloutServer, Completion]] = {}
        rows = list(range(len(prompts)))
        while rows:  # rows of a server found on other weights afterwards are sampled again
            with ThreadPoolExecutor(max_workers=min(32, max(1, len(rows)))) as pool:
                answers = pool.map(
                    lambda row: self._sample_row(row, prompts[row], seeds[row], body), rows
                )
                done |= dict(zip(rows, answers, strict=True))
            used = list({server.url: server for server, _ in done.values()}.values())
            stale = self.pool.verify(used, self.tag(self.version))
            rows = [row for row, (server, _) in done.items() if server.url in stale]
        return [done[row][1] for row in range(len(prompts))]

    def pool_metrics(self) -> dict[str, float]:
        """``rollout/servers_live``: the servers in rotation (logged with several only)."""
        return (
            {"rollout/servers_live": float(len(self.pool.live()))} if len(self.servers) > 1 else {}
        )

    @contextmanager
    def turn_stream(self, params: SamplingParams) -> Iterator[TurnStream]:
        """Rollout turns sent one request a row as soon as each row is ready, on the server
        :meth:`sample` would give the row; the servers' weight versions are checked before the
        first request and after the last."""
        if self.version is None:
            raise RuntimeError(
                "VLLMServerEngine.turn_stream before the first sync: call sync(policy) first"
            )
        self.pool.verify(self.pool.live(), self.tag(self.version))
        with ThreadPoolExecutor(max_workers=32) as pool:
            stream = _ServerTurns(self, pool, params)
            try:
                yield stream
            finally:
                for future in stream.pending:
                    future.cancel()
        used = list({server.url: server for server in stream.used}.values())
        if stale := self.pool.verify(used, self.tag(self.version)):
            raise RolloutServerError(
                f"rollout server {', '.join(sorted(stale))} left the rotation while it played this "
                "batch's episodes (they cannot be played again half way); run the same command "
                "again to resume"
            )

    def _sample_row(
        self, row: int, prompt: list[int], seed: int | None, body: dict
    ) -> tuple[RolloutServer, Completion]:
        """Row ``row`` sampled on its server, or on the next in rotation when that one fails."""
        while True:
            server = self.pool.server_for(row)
            try:
                return server, server.complete(prompt, seed, body, self.version)
            except RolloutServerError as error:
                if error.fault is None:
                    raise
                self.pool.take_out(server, error)

    def _body(self, temperature: float, max_tokens: int, greedy: bool) -> dict:
        body = neutral_sampling_body(
            max_tokens, 0.0 if greedy else temperature, self.stop_token_ids, self.stop_strings
        )
        body["allowed_token_ids"] = self.allowed_token_ids
        return body


class _ServerTurns:
    """A :class:`TurnStream` on the rollout servers: each turn one request on a thread of its
    own."""

    def __init__(self, engine: VLLMServerEngine, pool: ThreadPoolExecutor, params: SamplingParams):
        self.engine, self.pool, self.params = engine, pool, params
        self.pending: dict[Future, int] = {}
        self.used: list[RolloutServer] = []

    def submit(self, key: int, prompt: list[int], seed: int, max_tokens: int) -> None:
        engine, params = self.engine, self.params
        body = engine._body(params.temperature, max_tokens, params.greedy)
        future = self.pool.submit(engine._sample_row, key, prompt, seed, body)
        self.pending[future] = key

    def finished(self, waiting: bool = False) -> list[tuple[int, Completion]] | None:
        if not self.pending:
            return [] if waiting else None
        done, _ = wait(self.pending, return_when=FIRST_COMPLETED)
        finished = []
        for future in done:
            server, completion = future.result()
            self.used.append(server)
            finished.append((self.pending.pop(future), completion))
        return finished
