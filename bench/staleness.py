"""Collection ahead of learning: ``training.max_staleness`` 0 against 1 (and more) on the demo task,
with the reverse-KL advantage built from the behaviour or the current log-probs.

For each seed, the demo's run (its cached teacher and warmed-up student, 16 prompts x 4
samples, full fine-tune, lr 5e-4; the seed sets the run's data order, sampling and held-out
prompts) trains once per (staleness, ``training.advantage_logprobs``) setting, the settings
alternating in order from seed to seed; each run's student is then measured as the demo
measures it (greedy accuracy and sampled teacher KL on 200 held-out prompts). Seconds per step
are the run's wall time over its steps, measured in the same process one run after the other.

    python bench/staleness.py --out docs/results/staleness.json
    python bench/staleness.py --staleness 0 2 4 --advantage-logprobs behaviour current \
        --out docs/results/staleness_remedy.json
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from provenance import write_result


def one_run(
    staleness: int, source: str, seed: int, steps: int, teacher, eval_prompts, models
) -> dict:
    from opd.config import config_from_dict, config_to_dict
    from opd.demo.run import demo_config, measure
    from opd.trainer.loop import train

    teacher_dir, student_dir = models
    with tempfile.TemporaryDirectory() as directory:
        config = demo_config(str(Path(directory) / "run"), student_dir, teacher_dir, steps, seed)
        config |= {"eval_every": 0, "save_every": 0}
        config["training"] |= {"max_staleness": staleness, "advantage_logprobs": source}
        resolved = config_from_dict(config)
        started = time.perf_counter()
        trained = train(resolved, progress=False)
        seconds = time.perf_counter() - started
    rows = trained.metrics
    final = measure(trained.student, teacher, eval_prompts, seed)
    return {
        "max_staleness": staleness,
        "advantage_logprobs": source,
        "seed": seed,
        "seconds_per_step": seconds / steps,
        "wait_for_batch_median": statistics.median(r.get("time/wait_for_batch", 0.0) for r in rows),
        "train_median": statistics.median(r["time/train"] for r in rows),
        "final": final,
        "config": config_to_dict(resolved),
    }


def spread(values: list[float]) -> float:
    """The sample standard deviation (0 for a single value)."""
    return statistics.stdev(values) if len(values) > 1 else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2])
    parser.add_argument("--staleness", type=int, nargs="*", default=[0, 1])
    parser.add_argument(
        "--advantage-logprobs", nargs="*", default=["behaviour"], choices=["behaviour", "current"]
    )
    parser.add_argument(
        "--out", type=Path, help="also write the results here as JSON, with their provenance"
    )
    args = parser.parse_args()

    from opd.data.builtin_tasks import generate_task_prompts
    from opd.demo.char_tokenizer import build_char_tokenizer
    from opd.demo.run import NUM_EVAL_PROMPTS, STUDENT_SPEC, TASK, TEACHER_SPEC, ensure_model
    from opd.models import load_causal_lm
    from opd.teachers.local import LocalTeacher

    teacher_dir = ensure_model("teacher", TEACHER_SPEC, seed=0, log=lambda *_: None)
    student_dir = ensure_model("student", STUDENT_SPEC, seed=1, log=lambda *_: None)
    tokenizer = build_char_tokenizer()
    teacher = LocalTeacher(
        load_causal_lm(str(teacher_dir), "teacher.model", dtype="float32", device="cpu"),
        vocab_size=len(tokenizer),
        pad_id=tokenizer.pad_token_id,
    )
    settings = [(k, source) for k in args.staleness for source in args.advantage_logprobs]
    runs = []
    for seed in args.seeds:
        eval_prompts = generate_task_prompts(f"{TASK}@test", seed=seed, count=NUM_EVAL_PROMPTS)
        for staleness, source in settings if seed % 2 == 0 else settings[::-1]:
            run = one_run(
                staleness,
                source,
                seed,
                args.steps,
                teacher,
                eval_prompts,
                (teacher_dir, student_dir),
            )
            runs.append(run)
            print(
                f"seed {seed} max_staleness {staleness} {source}: accuracy "
                f"{run['final']['accuracy']:.3f} teacher KL {run['final']['teacher_kl']:.3f}  "
                f"{run['seconds_per_step']:.3f} s/step",
                flush=True,
            )
    print(
        f"\n{'max_staleness':>13} {'log-probs':>10} {'accuracy':>17} {'teacher KL':>17} "
        f"{'s/step':>7}"
    )
    summary = {}
    for staleness, source in settings:
        mine = [
            r for r in runs if (r["max_staleness"], r["advantage_logprobs"]) == (staleness, source)
        ]
        accuracy = [r["final"]["accuracy"] for r in mine]
        kl = [r["final"]["teacher_kl"] for r in mine]
        seconds = statistics.median(r["seconds_per_step"] for r in mine)
        summary[f"{staleness}/{source}"] = {
            "accuracy_mean": statistics.mean(accuracy),
            "accuracy_sd": spread(accuracy),
            "teacher_kl_mean": statistics.mean(kl),
            "teacher_kl_sd": spread(kl),
            "seconds_per_step_median": seconds,
        }
        print(
            f"{staleness:>13} {source:>10} {statistics.mean(accuracy):>9.3f} ± "
            f"{spread(accuracy):.3f} {statistics.mean(kl):>9.3f} ± {spread(kl):.3f} {seconds:>7.3f}"
        )
    write_result(args.out, "bench/staleness.py", vars(args), {"runs": runs, "summary": summary})


if __name__ == "__main__":
    main()
