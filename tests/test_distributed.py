"""torch.distributed with real processes: torchrun, gloo, 2 CPU processes, tiny models.

Two processes must make the update one process makes on the same global batch: the same
per-step metrics and final weights within 1e-5 (they differ only in the order floats are
summed), for DDP and FSDP2, full fine-tuning and LoRA, with collection ahead of learning, and
with packed micro-batches binned by tokens against padded rows on one process; a
sharded checkpoint resumes on one process and back; a rank killed mid-step stops the job with
a message and the same command resumes it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from opd.cli import main
from opd.runs.checkpoints import list_checkpoints
from opd.runs.metrics import read_jsonl
from opd.runs.sharded_state import has_sharded_state
from tests.conftest import quick_to_stop, tiny_llama

DEVICE = os.environ.get("OPD_TEST_DEVICE", "cpu")
"""``cuda`` for tests/gpu_distributed.sh: a GPU per process, NCCL."""
DTYPE = os.environ.get("OPD_TEST_DTYPE", "float32")
TOLERANCE = 1e-5 if DTYPE == "float32" else 2e-2
"""float32 sums in another order differ by ~1e-6; bfloat16 keeps 8 bits of mantissa."""
WORDS = ("abc", "hgf", "dcea", "bbad", "gah", "fed", "cab", "ggf")


@pytest.fixture(scope="module")
def models(tmp_path_factory, char_tokenizer) -> Path:
    root = tmp_path_factory.mktemp("distributed")
    for name, seed in (("student", 1), ("teacher", 2)):
        tiny_llama(len(char_tokenizer), seed=seed).save_pretrained(root / name)
        char_tokenizer.save_pretrained(root / name)
    quick_to_stop(tiny_llama(len(char_tokenizer), seed=1)).save_pretrained(root / "quick_student")
    char_tokenizer.save_pretrained(root / "quick_student")
    lines = [{"prompt": f"reverse {w}", "answer": w[::-1]} for w in WORDS]
    (root / "prompts.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return root


def run_config(models: Path, log_path: Path, **training) -> dict:
    """8 sequences a step (4 prompts x 2), two optimizer substeps, one sequence per micro-batch,
    two sequences per teacher forward, 5 held-out prompts evaluated every 2 steps."""
    return {
        "log_path": str(log_path),
        "seed": 0,
        "save_every": 1,
        "eval_every": 2,
        "student": {
            "model": str(models / "student"),
            "lora_rank": 0,
            "device": DEVICE,
            "dtype": DTYPE,
        },
        "teacher": {"model": str(models / "teacher"), "device": DEVICE, "dtype": DTYPE},
        "datasets": [
            {
                "name": "rev",
                "source": str(models / "prompts.jsonl"),
                "eval_source": str(models / "prompts.jsonl"),
                "eval_num_prompts": 5,  # 3 and 2 a process: a sharded teacher pads its forwards
                "groups_per_batch": 4,
                "group_size": 2,
            }
        ],
        "training": {
            "objective": "sampled_reverse_kl",
            "learning_rate": 1e-3,
            "max_tokens": 6,
            "max_steps": 3,
            "num_substeps": 2,
            "micro_batch_size": 1,
            "teacher_batch_size": 2,
        }
        | training,
    }


def write(config: dict, path: Path) -> Path:
    path.write_text(yaml.safe_dump(config))
    return path


def one_process(config_path: Path, *overrides: str) -> None:
    assert main(["train", str(config_path), *overrides, "--no-progress"]) == 0


def torchrun_command(config_path: Path, *overrides: str, nproc: int = 2) -> list[str]:
    return [
        sys.executable,
        "-m",
        "opd",
        "train",
        str(config_path),
        *overrides,
        "--no-progress",
        f"--nproc={nproc}",
    ]


def start_job(config_path: Path) -> subprocess.Popen:
    """``opd train --nproc 2`` in the background, its stderr kept."""
    return subprocess.Popen(
        torchrun_command(config_path),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=os.environ | {"OMP_NUM_THREADS": "1"},
    )


def wait_for_rows(job: subprocess.Popen, metrics: Path, rows: int) -> None:
    deadline = time.monotonic() + 240
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= rows):
        assert time.monotonic() < deadline and job.poll() is None, "the run made no progress"
        time.sleep(0.01)


def two_processes(config_path: Path, *overrides: str) -> None:
    done = subprocess.run(
        torchrun_command(config_path, *overrides),
        capture_output=True,
        text=True,
        timeout=300,
        env=os.environ | {"OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]


def two_nodes(config_path: Path, *overrides: str) -> None:
    """``opd train`` as two nodes of one process each (``torchrun --nnodes 2 --node_rank 0|1``),
    their rendezvous (c10d) on 127.0.0.1: each process has ``LOCAL_RANK`` 0."""
    from tests.servers import free_port

    launch = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1"]
    launch += [
        "--rdzv_backend=c10d",
        f"--rdzv_endpoint=127.0.0.1:{free_port()}",
        "--rdzv_id=opd-two-nodes",
    ]
    train_command = ["-m", "opd", "train", str(config_path), *overrides, "--no-progress"]
    jobs = [
        subprocess.Popen(
            [*launch, f"--node_rank={rank}", *train_command],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=os.environ | {"OMP_NUM_THREADS": "1"},
        )
        for rank in (0, 1)
    ]
    for job in jobs:
        _, stderr = job.communicate(timeout=300)
        assert job.returncode == 0, stderr[-3000:]


def assert_same_metrics(
    rows: list[dict], reference: list[dict], tolerance: float = TOLERANCE
) -> None:
    """Every metric of every row (held-out evaluations too) but times, within ``tolerance``."""
    assert [r["step"] for r in rows] == [r["step"] for r in reference]
    for row, expected in zip(rows, reference, strict=True):
        compared = {key for key in expected if not key.startswith(("time/", "progress/"))}
        assert compared <= set(row), sorted(compared - set(row))
        for key in compared:
            assert row[key] == pytest.approx(expected[key], abs=tolerance, rel=tolerance), (
                row["step"],
                key,
            )
    assert any("test/rev/accuracy" in row for row in rows)


def final_weights(run: Path, out: Path) -> dict[str, torch.Tensor]:
    """The last checkpoint's student, gathered by ``opd export`` when sharded."""
    assert main(["export", str(run), str(out)]) == 0
    (weights,) = [load_file(path) for path in out.glob("*.safetensors")]
    return weights


PACKED_BINS = ["training.micro_batch_size=null", "training.micro_batch_tokens=68"]
"""Packed micro-batches of at most 68 tokens (rows of 31 to 37: a process's two rows of a substep
in one forward when they fit, else two forwards, and then the other process splits its one),
against one padded row per forward on one process."""


MULTI_TURN = [
    "student.model={}",
    "datasets.0.env={name: retry, max_turns: 2, max_episode_tokens: 80}",
]
"""A student that ends most turns within a few tokens, in episodes of the ``retry`` environment:
processes play different numbers of turns, so they sample in lock step."""


@pytest.mark.parametrize(
    (
        "parallel",
        "lora_rank",
        "max_staleness",
        "objective",
        "normalize",
        "packed_bins",
        "multi_turn",
    ),
    [
        # each process holds half the batch; the advantages' mean and spread are the whole batch's.
        # (Not with LoRA here: there one adapter entry's second-step gradient is 4e-9, under AdamW's
        # eps, where the size of its step follows float rounding and differs by 2.5e-4.)
        ("ddp", 0, 0, "sampled_reverse_kl", True, False, False),
        ("fsdp", 0, 0, "sampled_reverse_kl", False, False, True),
        ("ddp", 4, 0, "sampled_reverse_kl", False, True, False),
        ("fsdp", 4, 0, "sampled_reverse_kl", False, True, False),
        # the teacher's top-k scores collected ahead, for the step after
        ("fsdp", 0, 1, "topk_forward_kl", False, False, False),
        # the fused heads read the (sharded) lm head inside the forward
        ("fsdp", 0, 0, "jsd", False, True, False),
    ],
)
def test_two_processes_make_the_update_one_process_makes(
    models,
    tmp_path,
    parallel,
    lora_rank,
    max_staleness,
    objective,
    normalize,
    packed_bins,
    multi_turn,
):
    overrides = [
        f"student.lora_rank={lora_rank}",
        f"training.max_staleness={max_staleness}",
        f"training.objective={objective}",
        f"training.normalize_advantages={str(normalize).lower()}",
        *([MULTI_TURN[0].format(models / "quick_student"), MULTI_TURN[1]] if multi_turn else []),
    ]
    single = write(run_config(models, tmp_path / "one"), tmp_path / "one.yaml")
    one_process(single, *overrides, *(["training.packing=false"] if packed_bins else []))
    double = write(run_config(models, tmp_path / "two"), tmp_path / "two.yaml")
    two_processes(
        double, *overrides, f"training.parallel={parallel}", *(PACKED_BINS if packed_bins else [])
    )

    reference, rows = (
        read_jsonl(tmp_path / "one" / "metrics.jsonl"),
        read_jsonl(tmp_path / "two" / "metrics.jsonl"),
    )
    assert_same_metrics(rows, reference)
    if multi_turn:
        assert (
            max(row.get("episode/turns", 0) for row in rows) > 1
        )  # some episodes took a second turn
    if max_staleness:
        assert [r["staleness_mean"] for r in rows if "staleness_mean" in r] == [0, 1, 1]
    last = list_checkpoints(tmp_path / "two")[-1]
    assert last.step == 3 and has_sharded_state(last.path)
    expected, got = (
        final_weights(tmp_path / "one", tmp_path / "out1"),
        final_weights(tmp_path / "two", tmp_path / "out2"),
    )
    assert set(got) == set(expected)
    if DTYPE != "float32":
        return  # a bfloat16 weight rounds by more than 3 steps at lr 1e-3 move it
    assert max(float((got[name] - expected[name]).abs().max()) for name in expected) < TOLERANCE
    moved = max(
        float((expected[name] - value).abs().max())
        for name, value in initial_weights(
            models, lora_rank, expected, "quick_student" if multi_turn else "student"
        ).items()
    )
    assert moved > 100 * TOLERANCE  # training moved the weights: the equality above is not trivial


def test_two_processes_centre_each_groups_rewards_as_one_process_does(
    models, tmp_path, monkeypatch
):
    """Rewards from a user's environment (episodes whose final reward differs within a group), with
    the teacher's term: each group lies whole on one process, so its mean is the same."""
    monkeypatch.setenv(
        "PYTHONPATH",
        os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]),
    )
    overrides = [
        f"student.model={models / 'quick_student'}",
        "datasets.0.env={name: multi_turn_envs:ReplyOnce, max_turns: 2, max_episode_tokens: 40}",
        "training.reward_coef=1.0",
    ]
    single = write(run_config(models, tmp_path / "one"), tmp_path / "one.yaml")
    one_process(single, *overrides)
    double = write(run_config(models, tmp_path / "two"), tmp_path / "two.yaml")
    two_processes(double, *overrides, "training.parallel=ddp")
    reference, rows = (
        read_jsonl(tmp_path / "one" / "metrics.jsonl"),
        read_jsonl(tmp_path / "two" / "metrics.jsonl"),
    )
    assert_same_metrics(rows, reference)
    steps = [row for row in reference if "reward/mean" in row]
    assert len(steps) == 3 and any(row["reward/group_std"] > 0 for row in steps)
    assert any(row["advantage/reward_abs_mean"] > 0 for row in steps)
    expected, got = (
        final_weights(tmp_path / "one", tmp_path / "out1"),
        final_weights(tmp_path / "two", tmp_path / "out2"),
    )
    # a group's centred rewards are +x and -x on rows that share most of their gradient: summed in
    # another order, the near-cancelling sums round apart by ~1e-5 of an Adam step (1.3e-6 without
    # rewards)
    tolerance = 5 * TOLERANCE
    assert max(float((got[name] - expected[name]).abs().max()) for name in expected) < tolerance
    moved = max(
        float((expected[name] - value).abs().max())
        for name, value in initial_weights(models, 0, expected, "quick_student").items()
    )
    assert moved > 100 * tolerance


def test_a_graded_and_an_ungraded_dataset_share_two_processes(models, tmp_path):
    """One dataset has a grader and one has none: whichever rows a process holds, every process
    reduces the reward metrics together (no process waits in a collective the others skip)."""
    plain = tmp_path / "plain.jsonl"
    plain.write_text("".join(json.dumps({"prompt": f"say {w}"}) + "\n" for w in WORDS))
    config = run_config(models, tmp_path / "one")
    graded = config["datasets"][0] | {"groups_per_batch": 2}
    config["datasets"] = [
        graded,
        graded | {"name": "plain", "source": str(plain), "eval_source": None},
    ]
    config["training"]["num_substeps"] = (
        1  # one process holds the graded groups, the other the rest
    )
    one_process(write(config, tmp_path / "one.yaml"))
    two_processes(
        write(config | {"log_path": str(tmp_path / "two")}, tmp_path / "two.yaml"),
        "training.parallel=ddp",
    )
    reference, rows = (
        read_jsonl(tmp_path / "one" / "metrics.jsonl"),
        read_jsonl(tmp_path / "two" / "metrics.jsonl"),
    )
    assert_same_metrics(rows, reference)
    assert all(
        "reward/rev" in row and "reward/plain" not in row for row in reference if "loss" in row
    )


def initial_weights(
    models: Path, lora_rank: int, like: dict[str, torch.Tensor], student: str = "student"
) -> dict[str, torch.Tensor]:
    """The weights before training, under the names a saved checkpoint uses."""
    if lora_rank:
        return {name: torch.zeros_like(value) for name, value in like.items() if "lora_B" in name}
    return load_file(models / student / "model.safetensors")


def test_a_sharded_checkpoint_resumes_on_one_process_and_back(models, tmp_path):
    reference = write(
        run_config(models, tmp_path / "reference", max_steps=6), tmp_path / "reference.yaml"
    )
    one_process(reference)
    moving = write(run_config(models, tmp_path / "moving"), tmp_path / "moving.yaml")
    two_processes(moving, "training.max_steps=2")
    one_process(moving, "training.max_steps=4")
    assert not has_sharded_state(list_checkpoints(tmp_path / "moving")[-1].path)
    two_processes(moving, "training.max_steps=6")

    rows = read_jsonl(tmp_path / "moving" / "metrics.jsonl")
    assert_same_metrics(rows, read_jsonl(tmp_path / "reference" / "metrics.jsonl"))
    assert [r.step for r in list_checkpoints(tmp_path / "moving")] == [1, 2, 3, 4, 5, 6]


def rank_pid(config_path: Path, rank: int) -> int | None:
    """The process of ``rank`` training ``config_path`` (found through /proc)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            command = (entry / "cmdline").read_bytes().split(b"\0")
            environment = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        ours = str(config_path).encode() in command and b"torch.distributed.run" not in command
        if ours and f"RANK={rank}".encode() in environment:
            return int(entry.name)
    return None


def test_a_rank_killed_mid_run_stops_the_job_and_the_same_command_resumes_it(models, tmp_path):
    """With ``max_staleness: 1``, so the resume also restores a batch in collection: the
    checkpoint's weights of that batch are read back by both processes, which collect it again as
    the uninterrupted run did (the synchronous loop's kill and resume: tests/test_resume.py)."""
    ahead = {"max_staleness": 1}
    reference = write(
        run_config(models, tmp_path / "reference", max_steps=6, **ahead),
        tmp_path / "reference.yaml",
    )
    two_processes(reference)
    killed = write(
        run_config(models, tmp_path / "killed", max_steps=6, **ahead), tmp_path / "killed.yaml"
    )
    metrics = tmp_path / "killed" / "metrics.jsonl"
    job = start_job(killed)
    wait_for_rows(job, metrics, 3)
    pid = rank_pid(killed, 1)
    assert pid is not None, "rank 1 not found"
    os.kill(pid, signal.SIGKILL)
    _, stderr = job.communicate(timeout=240)
    assert job.returncode != 0
    assert "Run the same command again to resume from the last checkpoint" in stderr
    steps_done = len(read_jsonl(metrics))
    assert steps_done < 6, "the run finished before it could be killed"

    two_processes(killed)
    reference_rows = read_jsonl(tmp_path / "reference" / "metrics.jsonl")
    rows = read_jsonl(metrics)
    assert [r["step"] for r in rows] == list(
        range(7)
    )  # none lost, none twice (6: the final evaluation)
    assert_same_metrics(rows, reference_rows, tolerance=1e-6)


def test_sigterm_stops_every_process_after_one_step_with_a_checkpoint_and_the_run_resumes(
    models, tmp_path
):
    """SIGTERM to ``opd train --nproc 2`` (as a scheduler sends it): forwarded to torchrun, which
    forwards it to each worker; every worker finishes the same step and the checkpoint is taken."""
    reference = write(
        run_config(models, tmp_path / "reference", max_steps=6), tmp_path / "reference.yaml"
    )
    one_process(reference, "training.parallel=none")
    config = run_config(models, tmp_path / "run", max_steps=6) | {"save_every": 0}
    path = write(config, tmp_path / "run.yaml")
    metrics = tmp_path / "run" / "metrics.jsonl"
    job = start_job(path)
    wait_for_rows(job, metrics, 2)
    job.send_signal(signal.SIGTERM)
    _, stderr = job.communicate(timeout=240)
    assert job.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    done = len([r for r in read_jsonl(metrics) if "loss" in r])
    assert 2 <= done < 6
    assert (
        stderr.count(f"opd: stopped by SIGTERM after step {done} of 6") == 2
    )  # each process, one step
    assert "opd: stopped by SIGTERM (torchrun exit status" in stderr
    assert [r.step for r in list_checkpoints(tmp_path / "run")] == [done]
    two_processes(path)
    assert_same_metrics(read_jsonl(metrics), read_jsonl(tmp_path / "reference" / "metrics.jsonl"))


@pytest.mark.parametrize(
    ("overrides", "nproc", "message"),
    [
        (["training.parallel=fsdp"], None, "training.parallel: fsdp needs several processes"),
        (["training.parallel=none"], 2, "training.parallel: none with 2 processes"),
        ([], 3, "into world size (3) x training.num_substeps (2) equal parts, and 8 sequences"),
        (["datasets.0.groups_per_batch=2"], 2, "sequence 1 would split a prompt's group"),
        (["training.dist_backend=nccl"], None, "training.dist_backend: nccl needs CUDA GPUs"),
    ],
)
def test_settings_that_do_not_fit_the_processes_are_refused_before_any_start(
    models, tmp_path, capsys, overrides, nproc, message
):
    if torch.cuda.is_available() and "nccl" in message:
        pytest.skip("this machine has CUDA: nccl is allowed")
    config = write(run_config(models, tmp_path / "run"), tmp_path / "run.yaml")
    args = ["train", str(config), *overrides] + ([f"--nproc={nproc}"] if nproc else [])
    assert main(args) == 2
    error = capsys.readouterr().err
    assert message in error and "Traceback" not in error
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("change", "sharded"),
    [
        ({}, True),
        ({"training": {"objective": "topk_forward_kl"}}, True),
        (
            {"training": {"objective": "jsd"}},
            False,
        ),  # reads the teacher's lm head outside its forward
        ({"training": {"max_staleness": 1}}, False),  # the worker thread scores
        ({"training": {"data_source": "mixed", "objective": "jsd"}}, False),  # the teacher samples
        ({"teacher": {"backend": "openai", "base_url": "http://127.0.0.1:1/v1"}}, False),
    ],
)
def test_the_local_teacher_is_sharded_with_the_student_where_every_process_calls_it_alike(
    models, tmp_path, change, sharded
):
    from opd.assemble.processes import shards_its_teacher
    from opd.config import config_from_dict

    config = run_config(models, tmp_path / "run")
    for section, values in change.items():
        config[section] = config[section] | values
    resolved = config_from_dict(config)
    assert shards_its_teacher(resolved, "fsdp") is sharded
    assert shards_its_teacher(resolved, "ddp") is False


def test_two_nodes_on_loopback_make_the_run_one_node_with_two_processes_makes(models, tmp_path):
    """``torchrun --nnodes 2`` with one process each, rendezvous (c10d) on 127.0.0.1, against one
    node with two processes: the same metrics and final weights, and the two nodes' checkpoint
    resumed on one node ends there too. Each node's process has
    ``LOCAL_RANK`` 0, so code that takes it for ``RANK`` (data shares, the one writer of the run)
    differs here."""
    one_node = write(run_config(models, tmp_path / "one-node"), tmp_path / "one-node.yaml")
    two_processes(one_node, "training.parallel=fsdp")
    nodes = write(run_config(models, tmp_path / "two-nodes"), tmp_path / "two-nodes.yaml")
    two_nodes(nodes, "training.parallel=fsdp")
    # one world of two (fsdp refuses one process), each node's shard saved once
    (last,) = list_checkpoints(tmp_path / "two-nodes")[-1:]
    assert sorted(p.name for p in (last.path / "state").glob("*.distcp")) == [
        "__0_0.distcp",
        "__1_0.distcp",
    ]
    assert_same_metrics(
        read_jsonl(tmp_path / "two-nodes" / "metrics.jsonl"),
        read_jsonl(tmp_path / "one-node" / "metrics.jsonl"),
    )
    ours = final_weights(tmp_path / "two-nodes", tmp_path / "two-nodes-export")
    reference = final_weights(tmp_path / "one-node", tmp_path / "one-node-export")
    for name, tensor in reference.items():
        torch.testing.assert_close(ours[name], tensor, atol=1e-5, rtol=0)
    # the two nodes' checkpoint of step 2 (a shard from each node) resumed on one node with two
    # processes: the last step redone ends where both runs ended
    shutil.rmtree(last.path)
    assert list_checkpoints(tmp_path / "two-nodes")[-1].step == 2
    two_processes(nodes, "training.parallel=fsdp")
    assert_same_metrics(
        read_jsonl(tmp_path / "two-nodes" / "metrics.jsonl"),
        read_jsonl(tmp_path / "one-node" / "metrics.jsonl"),
    )
    resumed = final_weights(tmp_path / "two-nodes", tmp_path / "resumed-export")
    for name, tensor in reference.items():
        torch.testing.assert_close(resumed[name], tensor, atol=1e-5, rtol=0)
