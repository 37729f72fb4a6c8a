"""A train type is a small strategy class registered by name; the loops call it, never the reverse."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import torch

from astrai.models.policy import router_aux_loss_coef
from astrai.models.token_forward import PLAIN_TOKENS, TokenForward
from astrai.train_types import TrainTypeRules

if TYPE_CHECKING:  # Run holds the strategy: named for annotations only, the strategies never import training/
    from astrai.training.run_parts import Run


@dataclass
class StepOutput:
    """What one micro-batch contributes: the loss to backpropagate and detached metric sums."""

    loss: torch.Tensor
    sums: dict[str, float] = field(
        default_factory=dict
    )  # summed over micro-batches and ranks, then divided by `sums["weight"]`


class Strategy:
    name: ClassVar[str]
    loop: ClassVar[str]  # "offline" or "online"
    required_parts: ClassVar[tuple[str, ...]] = ("policy",)  # what a checkpoint must hold to resume this train type
    engine_parts: ClassVar[tuple[str, ...]] = (
        "policy",
    )  # the trainable engines build_run makes (online_ppo adds "critic")
    renders_chats: ClassVar[bool] = True  # rows go through the tokenizer's chat template (not seq's plain text)
    # What the job's sections may hold for this train type, judged when a job loads (astrai/train_types.py, below
    # the config, which cannot import the strategies); the export and the planner read it too.
    rules: ClassVar[type[TrainTypeRules]]
    sequences_per_row: ClassVar[int] = 1  # sequences one data row makes in a micro-batch (a pair: 2)
    # The token statistics' forward, chosen once per job by build_run (models/token_forward.py): the plain one,
    # or the sequence-parallel cuts of `parallel.sequence_parallel_size`.
    tokens: TokenForward = PLAIN_TOKENS

    def __init__(self, job, tokenizer):
        self.job = job
        self.tokenizer = tokenizer

    # The interface the loops call, in the order they call it.
    def prepare_data(self, rows):
        """Raw rows -> (tokenised datasets.Dataset, number of malformed rows skipped)."""
        raise NotImplementedError

    def parts_to_resume(self, checkpoint: Path) -> tuple[str, ...]:
        """The engine parts a resume from `checkpoint` must load; a missing one fails the resume, named."""
        return self.required_parts

    @classmethod
    def check_job(cls, job, world_size: int) -> None:
        """Raise ConfigError for what only this train type rejects, given the world size (before any rank works)."""

    @classmethod
    def needs_reference(cls, job) -> bool:
        """Whether `setup` builds a frozen reference model; the planner counts its memory from this same answer."""
        return False

    @classmethod
    def keeps_reference(cls, job) -> bool:
        """Whether that reference stays in memory while the policy trains (dpo frees a precomputed one first)."""
        return cls.needs_reference(job)

    @classmethod
    def policy_module(cls, model, tokenizer):
        """The module the policy engine trains, from the built causal LM (`rm` puts a scalar head on its trunk)."""
        return model

    def optimizer_steps_per_step(self, world_size: int) -> int:
        """Optimizer updates in one trainer step; the LR schedule spans max_steps x this many."""
        return 1

    def rows_per_draw(self, world_size: int) -> int:
        """Rows one rank takes from the run's data order per draw (`run.DataStream`): a micro-batch."""
        return self.job.train.micro_batch_size

    def setup(self, run: Run) -> None:
        """Build what the strategy holds besides the trainable engines (e.g. a frozen reference)."""

    def checkpoint_meta(self) -> dict:
        """Facts a checkpoint of this train type records in its manifest (e.g. the reference used)."""
        return {}

    def state_dict(self) -> dict:
        """What the strategy itself must carry across a resume (e.g. an adaptive KL coefficient); JSON-able."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict()`'s mapping ({} for a checkpoint that has none)."""

    def collate(self, rows: list[dict]) -> dict:
        raise NotImplementedError

    def loss_weight(self, batch: dict) -> int:
        """How many units (tokens, pairs) the micro-batch's loss sums over; the step divides by the global total."""
        raise NotImplementedError

    def compute_loss(self, policy, batch: dict, normalizer: float) -> StepOutput:
        raise NotImplementedError

    # Evaluation of the offline loop (astrai/eval/offline.py): the sums of `eval_sums` over every held-out
    # micro-batch of every rank, then `eval_metrics` of those global sums, logged as `eval/<name>`.
    eval_metric_names: ClassVar[tuple[str, ...]] = ("loss",)  # what `eval_metrics` returns (keep_best checks it)

    def eval_sums(self, policy, batch: dict) -> dict[str, float]:
        """Metric sums of one held-out micro-batch (the caller holds torch.no_grad and eval mode): by default
        `compute_loss`'s sums, `weight` being the units (tokens, pairs) they are summed over."""
        return self.compute_loss(policy, batch, 1.0).sums

    def eval_metrics(self, totals: dict[str, float]) -> dict[str, float]:
        """Global sums of `eval_sums` -> the figures named in `eval_metric_names` (without the `eval/` prefix):
        by default each such sum divided by the summed `weight` (a train type whose compute_loss sums `loss`
        and, say, `accuracy` per pair gets both as means over every held-out pair)."""
        weight = max(totals.get("weight", 0.0), 1.0)
        return {name: totals[name] / weight for name in self.eval_metric_names if name in totals}

    # Mixture-of-experts policies: the router's load-balancing loss, the same way in every train type.
    def router_options(self, policy) -> dict:
        """Forward keywords that make the policy return its router's load-balancing loss (`aux_loss`):
        {"output_router_logits": True} when `model.router_aux_loss_coef` resolves to > 0 for it, else {}."""
        coefficient = router_aux_loss_coef(self.job.model.router_aux_loss_coef, policy)
        return {"output_router_logits": True} if coefficient > 0 else {}

    def router_aux_loss(self, policy, output, units: float, normalizer: float, sums: dict, metric_units: float):
        """coef x aux_loss x units / normalizer, the term to add to the micro-batch's loss (0 without one).

        aux_loss is the model's own (transformers' `load_balancing_loss_func`): a mean over the micro-batch's
        attended tokens, like a loss of its own. units / normalizer is the micro-batch's share of the step's
        loss units (tokens, pairs or responses: `loss_weight`) times ranks x accumulation, the factor its
        summed loss gets; DeepSpeed then divides by ranks x accumulation, so the step's router term is coef x
        the unit-weighted mean of its micro-batches' aux losses (coef x aux_loss when they are equal, as
        transformers' loss with labels). Adds `router_aux_loss` (aux_loss x metric_units) to `sums`:
        metric_units is what the loop divides that metric by (the loss units offline, response tokens online).
        """
        aux = getattr(output, "aux_loss", None)
        if not isinstance(aux, torch.Tensor):
            return 0.0
        sums["router_aux_loss"] = float(aux.detach()) * metric_units
        return router_aux_loss_coef(self.job.model.router_aux_loss_coef, policy) * aux * (units / normalizer)


REGISTRY: dict[str, type[Strategy]] = {}


def register(cls: type[Strategy]) -> type[Strategy]:
    if cls.rules.name != cls.name:  # the schema would judge the job by another train type's rules
        raise TypeError(f"strategy {cls.name!r} names the rules of {cls.rules.name!r}")
    REGISTRY[cls.name] = cls
    return cls


def strategy_class(train_type: str) -> type[Strategy]:
    import astrai.strategies  # noqa: F401  (registers every built-in train type)

    if train_type not in REGISTRY:
        raise KeyError(
            f"train.train_type: {train_type!r} is not available in this version (available: "
            f"{', '.join(sorted(REGISTRY))})"
        )
    return REGISTRY[train_type]
