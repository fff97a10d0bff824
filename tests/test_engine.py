"""The rollout-engine contract on the HF engine: explicit seeds, versions, behaviour log-probs."""

import torch

from opd.config import config_from_dict
from opd.data.sequences import build_rollout_batch
from opd.logprobs import sequence_logprobs
from opd.sampling.base import SamplingParams, row_seeds
from opd.trainer.loop import Trainer

PARAMS = SamplingParams(temperature=1.0, max_tokens=8)


def engine_and_prompts(base_config, **student):
    base_config["student"].update(student)
    trainer = Trainer(config_from_dict(base_config), progress=False)
    prompts = [
        trainer.parts.renderer.prompt_ids([{"role": "user", "content": q}]) for q in ("abc", "gfed")
    ] * 3
    return trainer, prompts


def test_a_seed_fixes_the_rollout_and_leaves_the_global_generator_alone(base_config):
    trainer, prompts = engine_and_prompts(base_config)
    engine = trainer.parts.engine
    engine.sync(trainer.parts.policy)
    torch.manual_seed(123)
    state = torch.get_rng_state()
    first = engine.rollout(prompts, PARAMS, seeds=row_seeds(7, len(prompts)))
    assert torch.equal(torch.get_rng_state(), state)
    again = engine.rollout(prompts, PARAMS, seeds=row_seeds(7, len(prompts)))
    other = engine.rollout(prompts, PARAMS, seeds=row_seeds(8, len(prompts)))
    assert [c.token_ids for c in first] == [c.token_ids for c in again]
    assert [c.token_ids for c in first] != [c.token_ids for c in other]


def test_a_rows_draws_depend_on_its_seed_only_not_on_its_batch_mates(base_config):
    """What lets N processes sample one process's batch: each shares out rows, keeping their
    seeds."""
    trainer, prompts = engine_and_prompts(base_config)
    trainer.parts.engine.sync(trainer.parts.policy)
    seeds = row_seeds(11, len(prompts))
    whole = trainer.parts.engine.rollout(prompts, PARAMS, seeds=seeds)
    halves = [
        trainer.parts.engine.rollout(prompts[rows], PARAMS, seeds=seeds[rows])
        for rows in (slice(0, 3), slice(3, None))
    ]
    assert [c.token_ids for c in halves[0] + halves[1]] == [c.token_ids for c in whole]
    reordered = trainer.parts.engine.rollout(prompts[::-1], PARAMS, seeds=seeds[::-1])
    assert [c.token_ids for c in reordered[::-1]] == [c.token_ids for c in whole]


def test_completions_carry_the_version_synced_and_their_behaviour_logprobs(base_config):
    trainer, prompts = engine_and_prompts(base_config, sampling_dtype="bfloat16")
    trainer.train_step(0)
    assert trainer.parts.policy.version == 1
    unsynced = trainer.parts.engine.rollout(prompts, PARAMS, seeds=row_seeds(0, len(prompts)))
    assert {c.policy_version for c in unsynced} == {0}  # not synced yet
    trainer.parts.engine.sync(trainer.parts.policy)
    completions = trainer.parts.engine.rollout(prompts, PARAMS, seeds=row_seeds(0, len(prompts)))
    assert {c.policy_version for c in completions} == {1}
    batch = build_rollout_batch(
        prompts, completions, [0] * len(prompts), trainer.parts.engine.pad_id
    )
    with torch.no_grad(), trainer.parts.engine.copy.rollout() as copied:
        recomputed, _ = sequence_logprobs(
            copied, batch.input_ids_BT, batch.attention_mask_BT, batch.mask_BT
        )
    mask = batch.mask_BT.bool()
    torch.testing.assert_close(recomputed[mask], batch.sampled_logprobs_BT[mask], atol=2e-2, rtol=0)
    assert batch.policy_version_B.tolist() == [1] * len(prompts)


def test_a_step_samples_the_same_whatever_came_before_it(base_config):
    """Rollouts depend on (seed, step) and the weights only: a fresh trainer given the weights of
    one that trained a step samples that trainer's next step exactly (what an exact resume
    needs)."""
    trainer, _ = engine_and_prompts(base_config)
    trainer.train_step(0)
    torch.manual_seed(999)  # whatever the global generator holds
    expected, _ = trainer.collector.sample_batch(1)
    fresh = Trainer(config_from_dict(base_config), progress=False)
    fresh.parts.policy.model.load_state_dict(trainer.parts.policy.model.state_dict())
    got, _ = fresh.collector.sample_batch(1)
    assert torch.equal(got.input_ids_BT, expected.input_ids_BT)
    assert torch.equal(got.sampled_logprobs_BT, expected.sampled_logprobs_BT)
