"""What the online train types (`grpo`, `online_ppo`) share: prompt data, batch geometry, rollouts,
rewards, the frozen reference and the replay minibatches. A subclass adds `frozen_targets` and the loss.

Batch geometry of one step (W ranks, M = train.micro_batch_size, A = train.grad_accum_steps):
each rank takes rollout.prompts_per_step / W prompts and samples group_size responses to each, so a
group never spans ranks and its advantages need no communication. DeepSpeed fixes A micro-batches
per optimizer step, so one minibatch is M x A sequences per rank (M x A x W in all) and each replay
epoch makes (sequences per rank) / (M x A) optimizer steps.

With rl.packing the sequences of a minibatch are instead cut into micro-batches of up to
train.micro_batch_tokens prompt + response tokens (rollout/packed_scoring.py), as the forwards of the rollout
and the frozen targets are: the count varies by step and rank, so every rank runs the largest count of
any rank (an empty micro-batch where it has fewer), and the loop marks DeepSpeed's accumulation boundary
itself. The normaliser still divides by A, as DeepSpeed divides every loss by A, so the update is the same.

With rl.dynamic_sampling a step may draw several rounds of prompts (`dynamic_sampling.py`); it still ends
with prompts_per_step / W whole groups per rank, so the geometry above holds.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

import datasets
import torch

from astrai.algos.dapo import overlong_penalty
from astrai.algos.masked import masked_aggregate, rows_with_tokens
from astrai.config import ConfigError
from astrai.data import render_rows
from astrai.engine import all_reduce_maxes, all_reduce_sums
from astrai.rollout import RolloutResult, build_reward, generate_rollout, reward_inputs, sampling_seed
from astrai.rollout.generation import behaviour_logprobs_source
from astrai.rollout.group_rollout import gather_rollout, group_share
from astrai.rollout.packed_scoring import token_micro_batches
from astrai.rollout.prompts import Prompts, prompt_batch
from astrai.rollout.scoring import ScoringForward, forward_batches, scoring_forward
from astrai.strategies.base import StepOutput, Strategy
from astrai.strategies.dynamic_sampling import StepSample, sample_dynamically
from astrai.strategies.frozen_reference import build_reference
from astrai.strategies.targets import Targets

if TYPE_CHECKING:  # Run holds the strategy: named for annotations only, the strategies never import training/
    from astrai.training.run_parts import Run

logger = logging.getLogger("astrai.online")

ROUND_STREAMS = 2**32  # seed streams of dynamic sampling's later rounds; streams 1 + epoch shuffle the replay epochs


@dataclass(frozen=True)
class BatchGeometry:
    prompts_per_rank: int
    sequences_per_rank: int  # prompts_per_rank x group_size
    micro_batch_size: int
    micro_batches_per_update: int  # train.grad_accum_steps
    updates_per_epoch: int  # optimizer steps per replay epoch

    @property
    def sequences_per_update(self) -> int:
        return self.micro_batch_size * self.micro_batches_per_update


def batch_geometry(job, world_size: int) -> BatchGeometry:
    """Check that a step's rollout splits into whole optimizer steps on every rank; say what to change if not."""
    rollout, train = job.rollout, job.train
    if rollout.prompts_per_step % world_size:
        raise ConfigError(
            f"rollout.prompts_per_step {rollout.prompts_per_step} does not split over {world_size} ranks: use a "
            f"multiple of {world_size}"
        )
    per_update = train.micro_batch_size * train.grad_accum_steps
    if job.rl.minibatch_size is not None and job.rl.minibatch_size != per_update * world_size:
        raise ConfigError(
            f"rl.minibatch_size {job.rl.minibatch_size} != train.micro_batch_size {train.micro_batch_size} x "
            f"train.grad_accum_steps {train.grad_accum_steps} x {world_size} ranks = {per_update * world_size}: "
            "DeepSpeed fixes the micro-batches of an optimizer step, so set train.grad_accum_steps to "
            f"{job.rl.minibatch_size / (train.micro_batch_size * world_size):g} or leave rl.minibatch_size null"
        )
    prompts_per_rank = rollout.prompts_per_step // world_size
    sequences = prompts_per_rank * rollout.group_size
    if sequences % per_update:
        raise ConfigError(
            f"each rank samples {prompts_per_rank} prompts x rollout.group_size {rollout.group_size} = {sequences} "
            f"responses, not a multiple of one minibatch's {per_update} per rank (train.micro_batch_size x "
            "train.grad_accum_steps)"
        )
    return BatchGeometry(
        prompts_per_rank, sequences, train.micro_batch_size, train.grad_accum_steps, sequences // per_update
    )


def check_token_budget(job) -> None:
    """rl.packing: the longest sequence a rollout can make (data.max_seq_len + rollout.max_new_tokens) must fit
    in one micro-batch of train.micro_batch_tokens, since a sequence is never split."""
    longest = job.data.max_seq_len + job.rollout.max_new_tokens
    if job.rl.packing and longest > job.train.micro_batch_tokens:
        raise ConfigError(
            f"rl.packing: a rollout sequence may have data.max_seq_len {job.data.max_seq_len} + "
            f"rollout.max_new_tokens {job.rollout.max_new_tokens} = {longest} tokens, more than "
            f"train.micro_batch_tokens {job.train.micro_batch_tokens}: raise train.micro_batch_tokens to at least "
            f"{longest} (a sequence is never split)"
        )


def check_dapo_settings(job) -> None:
    """rl.dynamic_sampling and rl.overlong_penalty against the rest of the job, before any rank starts. (grpo's
    rollout.group_size >= 2, which dynamic sampling also needs, is checked by the schema.)"""
    settings = job.rl
    if settings.dynamic_sampling and job.train.train_type != "grpo":
        raise ConfigError(
            f"rl.dynamic_sampling needs train.train_type grpo, not {job.train.train_type}: it drops groups whose "
            "rewards are all equal because their group-relative advantages are 0, which a critic's advantages are not"
        )
    penalty = settings.overlong_penalty
    if penalty is not None:
        max_tokens = penalty.max_tokens or job.rollout.max_new_tokens
        if max_tokens > job.rollout.max_new_tokens:
            raise ConfigError(
                f"rl.overlong_penalty.max_tokens {max_tokens} > rollout.max_new_tokens {job.rollout.max_new_tokens}: "
                "no response reaches it; set it to at most rollout.max_new_tokens (or null: rollout.max_new_tokens)"
            )
        if penalty.buffer_tokens > max_tokens:
            raise ConfigError(
                f"rl.overlong_penalty.buffer_tokens {penalty.buffer_tokens} > rl.overlong_penalty.max_tokens "
                f"{max_tokens}{'' if penalty.max_tokens else ' (rollout.max_new_tokens)'}: "
                "the penalty would start before the response does"
            )


def replay_order(geometry: BatchGeometry, group_size: int, by_group: bool, generator: torch.Generator) -> torch.Tensor:
    """A replay epoch's order of this rank's sequences: a permutation of them all, or with rl.share_prefix of
    whole groups (a rollout lays a group's responses out together), so that a micro-batch of group_size x k
    sequences holds k prompts to run once each; verl's minibatches keep groups together too."""
    if not by_group:
        return torch.randperm(geometry.sequences_per_rank, generator=generator)
    groups = torch.randperm(geometry.sequences_per_rank // group_size, generator=generator)
    return (groups[:, None] * group_size + torch.arange(group_size)).flatten()


def round_seed(seed: int, step: int, rank: int, sampling_round: int) -> int:
    """The sampling seed of one round of a step on one rank; round 0 is `sampling_seed(seed, step, rank)`,
    so a run without rl.dynamic_sampling samples what it always did."""
    if sampling_round == 0:
        return sampling_seed(seed, step, rank)
    return sampling_seed(seed, step, rank, stream=ROUND_STREAMS + sampling_round)


class OnlineStrategy(Strategy):
    loop = "online"

    def prepare_data(self, rows) -> tuple[datasets.Dataset, int]:
        return render_rows(
            rows, prompt_batch, tokenizer=self.tokenizer, data=self.job.data, description="rendering prompts"
        )

    @classmethod
    def check_job(cls, job, world_size: int) -> None:
        """world_size: the data-parallel ranks (a sequence-parallel group shares its prompts)."""
        geometry = batch_geometry(job, world_size)
        size = job.parallel.sequence_parallel_size
        if geometry.prompts_per_rank % size:
            raise ConfigError(
                f"parallel.sequence_parallel_size: {size} ranks share each data-parallel rank's "
                f"{geometry.prompts_per_rank} prompts of a step (rollout.prompts_per_step / data-parallel ranks) to "
                f"generate: use a multiple of {size} prompts per data-parallel rank"
            )
        check_token_budget(job)
        check_dapo_settings(job)

    @classmethod
    def needs_reference(cls, job) -> bool:
        return job.rl.kl_coef > 0  # the KL to it is the only use of a reference (rl.target_kl needs kl_coef > 0)

    def optimizer_steps_per_step(self, world_size: int) -> int:
        """Optimizer updates of one step (rollout): what an LR schedule over train.max_steps must multiply by."""
        return batch_geometry(self.job, world_size).updates_per_epoch * self.job.rl.epochs_per_rollout

    def rows_per_draw(self, world_size: int) -> int:
        """One step's prompts per rank: a draw from the run's data order is one rollout's (or round's) prompts."""
        return batch_geometry(self.job, world_size).prompts_per_rank

    def setup(self, run: Run) -> None:
        # The ranks of a sequence-parallel group share their prompts and sequences: the geometry is the
        # data-parallel ranks' (rollout/group_rollout.py splits the generation over the group).
        self.geometry = batch_geometry(self.job, run.dist.data_parallel_size)
        self.dist = run.dist
        self.reward = build_reward(self.job.reward, run.dist.device)
        self.reference, self.reference_source = None, None
        updates = self.optimizer_steps_per_step(run.dist.data_parallel_size)
        logger.info(
            "%s: %d prompts x %d responses per rank per step, %d optimizer steps per step, reward %s",
            self.name,
            self.geometry.prompts_per_rank,
            self.job.rollout.group_size,
            updates,
            ", ".join(self.reward.names),
        )
        if self.needs_behaviour_logprobs():
            setting, precision = self.job.rollout.behaviour_logprobs, run.engines["policy"].precision
            logger.info(
                "behaviour log-probs: %s (rollout.behaviour_logprobs: %s, policy in %s)",
                behaviour_logprobs_source(setting, precision),
                setting,
                precision,
            )

    def build_reference(self, run: Run) -> None:
        """The frozen reference (as `dpo`'s): `model.reference_path`, else the policy's starting weights;
        partitioned like the policy under ZeRO-3."""
        self.reference, self.reference_source = build_reference(
            self.job, self.tokenizer, run.engines["policy"].ds_config, policy=run.engines["policy"]
        )

    def checkpoint_meta(self) -> dict:
        return {"reference": self.reference_source, "reward": self.reward.names}

    # The loop calls these in order, once per step (minibatches once per replay epoch).
    def sample(self, policy, prompt_batches: Iterator[list[dict]], *, step: int, policy_version: int) -> StepSample:
        """The step's scored rollout from the next prompts (`run.data.batches()`, which counts what is drawn):
        one round, or rl.dynamic_sampling's rounds."""
        if self.job.rl.dynamic_sampling:
            return sample_dynamically(self, policy, prompt_batches, step=step, policy_version=policy_version)
        if self.dist.sequence_parallel_size > 1:
            return StepSample(
                self._group_rollout(policy, next(prompt_batches), step, policy_version),
                self.job.rollout.prompts_per_step,
            )
        rollout = self.rollout(policy, next(prompt_batches), step=step, policy_version=policy_version)
        self.score(rollout)
        return StepSample(rollout, self.job.rollout.prompts_per_step)

    def _group_rollout(self, policy, examples: list[dict], step: int, policy_version: int) -> RolloutResult:
        """Sequence parallelism: this rank samples and rewards its share of the group's prompts (seeded as a
        data-parallel rank), the group gathers the shares (rollout/group_rollout.py), and the behaviour
        log-probs of the whole rollout come from the group's sequence-parallel forward."""
        dist = self.dist
        share = group_share(examples, dist.sequence_parallel_size, dist.sequence_parallel_rank)
        from_sampler = self.needs_behaviour_logprobs() and self.job.rollout.behaviour_logprobs == "sampler"
        rollout = generate_rollout(
            policy,
            self.tokenizer,
            Prompts.from_examples(share),
            self.job.rollout,
            seed=round_seed(self.job.train.seed, step, dist.rank, 0),
            scoring=self.scoring if from_sampler else None,  # "sampler": kept from the sampling, no forward
        )
        rollout.policy_version = policy_version
        self.score(rollout)  # each rank rewards its own share: a reward service sees every response once
        rollout = gather_rollout(rollout, dist.sequence_group, dist.sequence_parallel_size, self.tokenizer.pad_token_id)
        if self.needs_behaviour_logprobs() and rollout.behaviour_logprobs is None:
            rollout.behaviour_logprobs = self.scoring.frozen_logprobs(policy, rollout.training_tensors())
        if self.job.rl.mask_truncated:
            rollout.loss_rows = ~rollout.truncated
        return rollout

    def rollout(
        self, policy, examples: list[dict], *, step: int, policy_version: int, sampling_round: int = 0
    ) -> RolloutResult:
        rollout = generate_rollout(
            policy,
            self.tokenizer,
            Prompts.from_examples(examples),
            self.job.rollout,
            seed=round_seed(self.job.train.seed, step, self.dist.rank, sampling_round),
            scoring=self.scoring if self.needs_behaviour_logprobs() else None,
        )
        rollout.policy_version = policy_version
        if self.job.rl.mask_truncated:
            rollout.loss_rows = ~rollout.truncated
        return rollout

    def needs_behaviour_logprobs(self) -> bool:
        """Whether the loss needs the sampling policy's log-probs recomputed at rollout time."""
        return True

    @cached_property
    def scoring(self) -> ScoringForward:
        """The job's scoring forward (rollout/scoring.py: plain, packed or shared-prefix), built once: what the
        behaviour, reference and critic targets and the losses ask for log-probs, entropy and values. Its
        no-gradient forwards run in `forward_batches`."""
        return scoring_forward(self.job, len(self.tokenizer), self.forward_batches, self.tokens)

    def score(self, rollout: RolloutResult) -> None:
        """Set `rollout.rewards` [N] (and its components) from the `reward:` section, plus rl.overlong_penalty.
        `sample` scores every rollout; a rollout already scored is left as it is."""
        if rollout.rewards is not None:
            return
        scores = self.reward(reward_inputs(rollout))
        device = rollout.response_ids.device
        rollout.rewards = scores.total.to(device)
        rollout.reward_components = {name: values.to(device) for name, values in scores.components.items()}
        settings = self.job.rl.overlong_penalty
        if settings is not None:
            lengths = rollout.response_mask.sum(dim=1)  # tokens, EOS included
            rollout.overlong_penalties = overlong_penalty(
                lengths,
                max_tokens=settings.max_tokens or self.job.rollout.max_new_tokens,
                buffer_tokens=settings.buffer_tokens,
                penalty_factor=settings.penalty_factor,
            )
            rollout.rewards = rollout.rewards + rollout.overlong_penalties

    def frozen_targets(self, rollout: RolloutResult) -> Targets:
        """The step's targets (`targets.py`): everything the losses read, fixed for every replay epoch."""
        raise NotImplementedError

    def trains_part(self, part: str, step: int) -> bool:
        """Whether engine `part` (one of `engine_parts`) updates this step (online_ppo's critic warmup steps
        leave the policy alone)."""
        return True

    def part_loss(self, part: str, engine, batch: dict, normalizer: float) -> StepOutput:
        """The loss of engine `part` on one micro-batch: `compute_loss` for the policy (a strategy with more
        engine parts adds theirs)."""
        if part != "policy":
            raise NotImplementedError(f"{self.name} has no loss for engine part {part!r}")
        return self.compute_loss(engine, batch, normalizer)

    def sum_over_ranks(self, values: list[float]) -> list[float]:
        """Each number added over every data-parallel rank (one all-reduce): what algos' step-wide statistics take.
        The ranks of a sequence-parallel group hold the same sequences: their sum is divided by the group's size
        (exact for counts; a count would otherwise enter an unbiased variance's n - 1 sp times)."""
        group = self.dist.sequence_parallel_size
        return [value / group for value in all_reduce_sums(values, self.dist.device)]

    def loss_weight(self, batch: dict) -> int:
        """Loss units of the micro-batch: response tokens (token_mean) or responses with at least one
        token (sequence_mean: a response without tokens has no mean, so it counts nowhere)."""
        if self.job.rl.loss_aggregation == "token_mean":
            return int(batch["response_mask"].sum())
        return int(rows_with_tokens(batch["response_mask"]).sum())

    def aggregation(self, normalizer: float) -> dict:
        """The `masked_aggregate` arguments that divide this micro-batch's unit losses by `normalizer`
        (the step's global loss units / (ranks x accumulation), see `loss_weight`)."""
        if self.job.rl.loss_aggregation == "token_mean":
            return {"aggregation": "global", "global_token_count": normalizer}
        return {"aggregation": "global_sequence", "global_sequence_count": normalizer}

    @staticmethod
    def unit_sum(loss: torch.Tensor, normalizer: float) -> float:
        """The sum of the micro-batch's unit losses behind `loss` (= that sum / normalizer, see `aggregation`):
        what a loss metric sums, so that `step_metrics` divides it by the step's loss units once."""
        return float(loss.detach()) * normalizer

    def _aggregate(self, per_token: torch.Tensor, mask: torch.Tensor, normalizer: float) -> torch.Tensor:
        """Sum of this micro-batch's unit losses / normalizer (see `loss_weight`)."""
        arguments = self.aggregation(normalizer)
        return masked_aggregate(per_token, mask, arguments.pop("aggregation"), **arguments)

    @property
    def cuts_by_tokens(self) -> bool:
        """rl.packing: micro-batches of up to train.micro_batch_tokens tokens, a varying number per step."""
        return self.job.rl.packing

    def agree_counts(self, counts: list[int]) -> list[int]:
        """Each count's largest value over the ranks (one all-reduce): the micro-batches every rank runs."""
        return all_reduce_maxes(counts, self.dist.device)

    def token_cuts(self, sequences: dict[str, torch.Tensor], groups: list[torch.Tensor]) -> list[list[list[int]]]:
        """rl.packing: each group of sequence indices (a minibatch, or all) cut by `token_micro_batches`, as
        indices into `sequences`, padded with empty micro-batches to the count the ranks agree on."""
        tokens = sequences["attention_mask"].sum(dim=1).tolist()
        budget = self.job.train.micro_batch_tokens
        cuts = []
        for group in groups:
            members = group.tolist()
            cut = token_micro_batches([tokens[index] for index in members], budget)
            cuts.append([[members[position] for position in batch] for batch in cut])
        counts = self.agree_counts([len(cut) for cut in cuts])
        return [cut + [[] for _ in range(count - len(cut))] for cut, count in zip(cuts, counts)]

    def forward_batches(self, sequences: dict[str, torch.Tensor]) -> list[list[int]]:
        """The micro-batches of a no-gradient forward over all of this rank's sequences (behaviour, reference,
        critic values), as sequence indices: rl.packing's token cut (an empty one is a forward whose output is
        dropped, so that every rank runs as many), else train.micro_batch_size sequences at a time."""
        if not self.cuts_by_tokens:
            return forward_batches(sequences["input_ids"].shape[0], self.geometry.micro_batch_size)
        return self.token_cuts(sequences, [torch.arange(sequences["input_ids"].shape[0])])[0]

    def minibatches(self, targets: Targets, *, step: int, epoch: int) -> Iterator[list[dict[str, torch.Tensor]]]:
        """One list of micro-batches per optimizer step, over a fresh permutation of this rank's sequences each
        epoch (seeded by step, epoch and rank, so a resumed run replays the same): grad_accum_steps of
        micro_batch_size sequences, or with rl.packing its token cut (`token_cuts`; an empty micro-batch is one
        sequence without loss tokens, so that the rank still runs its forward and backward). With rl.share_prefix
        the permutation moves whole groups (`replay_order`)."""
        geometry = self.geometry
        generator = torch.Generator().manual_seed(
            sampling_seed(self.job.train.seed, step, self.dist.data_parallel_rank, stream=1 + epoch)
        )
        order = replay_order(geometry, self.job.rollout.group_size, self.job.rl.share_prefix, generator)
        order = order.to(targets["input_ids"].device)
        updates = order.split(geometry.sequences_per_update)
        if not self.cuts_by_tokens:
            for update in updates:
                yield [
                    {key: value[micro] for key, value in targets.items()}
                    for micro in update.split(geometry.micro_batch_size)
                ]
            return
        for update, cut in zip(updates, self.token_cuts(targets, [update.cpu() for update in updates])):
            micro_batches = []
            for rows in cut:
                index = torch.tensor(rows or [int(update[0])], device=order.device)
                micro = {key: value[index] for key, value in targets.items()}
                if not rows:  # weight 0: no loss token, so it adds nothing to the loss, the gradients or the sums
                    micro["response_mask"] = torch.zeros_like(micro["response_mask"])
                micro_batches.append(micro)
            yield micro_batches
