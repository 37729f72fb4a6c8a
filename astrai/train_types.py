"""What each train type allows in a job's sections, and the facts of it that layers below the strategies read.

One small class per train type, registered by name; each strategy names its own (`Strategy.rules`), so the
schema's cross-section checks (run by pydantic when a job loads), the planner, the export and the run read
one definition, and no module tests `train.train_type` against a name.

Why not in astrai/strategies/: the schema judges these rules while a job loads, and the strategies import the
config (ConfigError) and torch, DeepSpeed and transformers (seconds). The config importing the strategies would
be an import circle and make every job load pay for those imports; so the rules sit below both, standard
library only. The rules raise ValueError, which pydantic reports as `<file>: (top level): <message>`.
"""

from __future__ import annotations

from typing import ClassVar


class TrainTypeRules:
    name: ClassVar[str]
    online: ClassVar[bool] = False  # samples rollouts: the rollout, reward and rl sections apply
    # Keys that only some train types use; another train type setting one is refused, naming those that use it.
    options: ClassVar[frozenset[str]] = frozenset()
    data_packing_hint: ClassVar[str] = " (use `rl.packing`)"  # what to use instead of data.packing
    # rm: the policy engine trains the trunk under a scalar reward head, and its export is a sequence classifier.
    reward_head: ClassVar[bool] = False

    @classmethod
    def check_sections(cls, job) -> None:
        """Raise ValueError for what the job's sections hold that this train type cannot use (at load time)."""

    @classmethod
    def kl_placement(cls, rl) -> str:
        """Where the KL to the reference goes: "reward" or "loss" (`rl` is the job's RlConfig)."""
        return "reward" if rl.advantage_estimator == "reinforce_pp" else "loss"

    @classmethod
    def warnings(cls, job) -> list[str]:
        """What the job may do but almost certainly should not: logged once, on rank 0, as the run builds."""
        return []


RULES: dict[str, type[TrainTypeRules]] = {}


def register_rules(cls: type[TrainTypeRules]) -> type[TrainTypeRules]:
    RULES[cls.name] = cls
    return cls


def train_type_rules(train_type: str) -> type[TrainTypeRules]:
    """The rules of a train type the schema accepts (train.train_type is validated before any rule runs)."""
    return RULES[train_type]


def users_of(option: str) -> str:
    """The train types that use `option`, as a message names them ("sft and dpo")."""
    names = [rules.name for rules in RULES.values() if option in rules.options]
    return " and ".join(filter(None, (", ".join(names[:-1]), names[-1])))


@register_rules
class SeqRules(TrainTypeRules):
    name = "seq"
    options = frozenset({"data.document_mask", "parallel.sequence_parallel_size"})
    data_packing_hint = " (seq blocks have no padding; `data.document_mask` isolates their documents)"


@register_rules
class SftRules(TrainTypeRules):
    name = "sft"
    options = frozenset({"data.packing", "parallel.sequence_parallel_size"})


@register_rules
class DpoRules(TrainTypeRules):
    name = "dpo"
    options = frozenset({"data.packing", "parallel.sequence_parallel_size"})


class OnlineRules(TrainTypeRules):
    """What grpo and online_ppo share: a reward, steps counted in rollouts, the KL's placement."""

    online = True
    options = frozenset({"rl.packing", "rl.share_prefix", "parallel.sequence_parallel_size"})

    @classmethod
    def kl_loss_setting(cls, rl) -> str:
        """The setting that puts the KL into the loss, as a refusal names it."""
        return f"`rl.advantage_estimator: {rl.advantage_estimator}`"

    @classmethod
    def check_rl_options(cls, job) -> None:
        """RL options that cannot work together for this train type (docs/guides/rl.md)."""
        rl = job.rl
        kl_active = rl.kl_coef > 0 or rl.target_kl is not None
        if kl_active and cls.kl_placement(rl) == "loss" and rl.kl_kind(cls.name) == "k1":
            raise ValueError(
                f"`rl.kl_estimator: k1` as a loss term ({cls.kl_loss_setting(rl)}) has zero expected gradient: use "
                "k3 or k2 there, or put the KL in the reward (online_ppo: rl.kl_in_reward: true; grpo: "
                "rl.advantage_estimator: reinforce_pp)"
            )

    @classmethod
    def warnings(cls, job) -> list[str]:
        rl = job.rl
        kl_active = rl.kl_coef > 0 or rl.target_kl is not None
        kind = rl.kl_kind(cls.name)
        if not (kl_active and cls.kl_placement(rl) == "reward" and kind in ("k2", "k3")):
            return []
        # A penalty in the reward reaches pi through the score function, E[k grad log pi]: for k1 that is
        # grad KL(pi || ref); for k3 grad [KL(pi || ref) - KL(ref || pi)], for k2 a second-order term: both ~0
        # near the reference (docs/guides/rl.md, "Which KL estimator where"; tests/unit/algos/test_kl_gradients.py)
        return [
            f"rl.kl_estimator: {kind} with the KL in the reward: its policy gradient is not the KL's (only k1's is) "
            "and is nearly 0 near the reference, so the KL barely holds the policy back; use k1 there (the "
            "default), or put the KL in the loss"
        ]


@register_rules
class GrpoRules(OnlineRules):
    name = "grpo"

    @classmethod
    def check_sections(cls, job) -> None:
        estimator = job.rl.advantage_estimator
        if estimator != "reinforce_pp" and job.rollout.group_size < 2:
            raise ValueError(
                f"grpo compares each response with the others of its group: `rollout.group_size` must be >= 2 "
                f"with `rl.advantage_estimator: {estimator}` (only reinforce_pp has no group baseline)"
            )


@register_rules
class OnlinePpoRules(OnlineRules):
    name = "online_ppo"

    @classmethod
    def check_sections(cls, job) -> None:
        if job.critic.warmup_rollouts >= job.train.max_steps:
            raise ValueError(
                f"`critic.warmup_rollouts` ({job.critic.warmup_rollouts}) leaves no step of `train.max_steps` "
                f"({job.train.max_steps}) to train the policy"
            )

    @classmethod
    def kl_placement(cls, rl) -> str:
        return "reward" if rl.kl_in_reward else "loss"

    @classmethod
    def kl_loss_setting(cls, rl) -> str:
        return "`rl.kl_in_reward: false`"

    @classmethod
    def check_rl_options(cls, job) -> None:
        estimator = job.rl.advantage_estimator
        if estimator != "grpo":
            raise ValueError(
                f"`rl.advantage_estimator: {estimator}` is for `train.train_type: grpo`; online_ppo's advantages "
                "are GAE with its critic"
            )
        super().check_rl_options(job)


@register_rules
class RmRules(TrainTypeRules):
    name = "rm"
    options = frozenset({"rm.share_prefix", "parallel.sequence_parallel_size"})
    reward_head = True
