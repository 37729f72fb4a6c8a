"""Real DeepSpeed on 2 gloo ranks: training, ZeRO-stage and accumulation invariance, exact resume,
DPO (learning under ZeRO-3, precomputed and default/other references, the shipped configs/dpo.yaml).

All runs share ONE launch of ranks (a launch costs 10-20 s of imports). Tolerances: CPU fp32;
ZeRO stages differ only in reduction order, so losses agree to ~1e-6 relative; we allow 1e-4.
"""

from __future__ import annotations

import json
import math

import pytest

from astrai.checkpoint import CheckpointPublisher, verify_checkpoint
from tests.conftest import REPO
from tests.integration.plan import launch_plan, metrics, write_job

pytestmark = pytest.mark.slow
RTOL = 1e-4


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    folder = tmp_path_factory.mktemp("train_ranks")
    runs = []

    def add(name, train_type="sft", sets=(), **extra):
        runs.append({"name": name, "config": write_job(folder, name, train_type), "set": list(sets), **extra})

    for train_type in ("sft", "seq"):
        for stage in (2, 3):
            add(f"{train_type}_z{stage}", train_type, [f"deepspeed.zero_stage={stage}"])
    next(r for r in runs if r["name"] == "sft_z2")["set"].append(
        "export.on_finish=true"
    )  # the DPO runs' other reference
    add("sft_z1", "sft", ["deepspeed.zero_stage=1", "train.max_steps=3", "export.on_finish=true"])
    add("accumulate_2x2", "sft", ["train.micro_batch_size=2", "train.grad_accum_steps=2", "train.max_steps=3"])
    add("accumulate_4x1", "sft", ["train.micro_batch_size=4", "train.grad_accum_steps=1", "train.max_steps=3"])
    for stage in (2, 3):
        every = [f"deepspeed.zero_stage={stage}", "checkpoint.every_steps=4", "train.max_steps=8"]
        add(f"straight_z{stage}", "sft", every)
        first = write_job(folder, f"split_z{stage}", "sft")
        runs.append({"name": f"split_z{stage}_a", "config": first, "set": every[:2] + ["train.max_steps=4"]})
        runs.append({"name": f"split_z{stage}_b", "config": first, "set": every + ["checkpoint.verify_on_load=true"]})
    # checkpoint.async_save: straight_z3's training, its saves at 2, 4 and 6 hashed, fsynced and published
    # from a background thread while both ranks train on (8, the final one, synchronously); then a run
    # resuming from step 6, a checkpoint published that way.
    add(
        "async_z3",
        "sft",
        ["deepspeed.zero_stage=3", "checkpoint.every_steps=2", "train.max_steps=8", "checkpoint.async_save=true"],
    )
    add(
        "async_resume",
        "sft",
        [
            "deepspeed.zero_stage=3",
            "train.max_steps=8",
            f"checkpoint.resume={folder / 'async_z3' / 'checkpoints' / 'step_00000006'}",
        ],
    )
    # Resume from a plain DeepSpeed folder (no manifest): the policy/ folder of split_z2's step 4,
    # copied by the test before the launch would be too early, so point straight at it.
    legacy_source = folder / "split_z2" / "checkpoints" / "step_00000004" / "policy"
    add("legacy", "sft", ["deepspeed.zero_stage=2", "train.max_steps=8", f"checkpoint.resume={legacy_source}"])
    # A checkpoint without the policy part: resume must refuse before any step.
    lacking = folder / "lacking" / "step_00000003"
    CheckpointPublisher(lacking.parent, parts=["critic"]).publish(
        3, lambda staging: (staging / "critic").mkdir() or (staging / "critic" / "w").write_text("x")
    )
    add("refuse", "sft", ["train.max_steps=8", f"checkpoint.resume={lacking}"], expect_error="lacks")
    # A from-scratch model cannot do arithmetic, so DPO's signal here is 16 pairs seen for 6 epochs:
    # the policy must learn to prefer each chosen answer over its rejected one.
    pairs = folder / "pairs.jsonl"
    pairs.write_text("".join((REPO / "data/arithmetic/preference.jsonl").read_text().splitlines(keepends=True)[:16]))
    dpo = ["deepspeed.zero_stage=3", "dpo.beta=0.5", f"data.path={pairs}"]
    add("dpo_z3", "dpo", dpo)
    add("dpo_z3_precomputed", "dpo", dpo + ["dpo.precompute_reference=true"])
    add("dpo_straight", "dpo", ["checkpoint.every_steps=4", "train.max_steps=8"])
    # The shipped configs/dpo.yaml from an SFT export of this launch (sft_z1: 3 steps), small sizes; as
    # shipped (ZeRO-2), then with the policy and the reference both loaded partitioned (ZeRO-3), then
    # against another reference (sft_z2's export: 12 steps).
    shipped = [
        f"data.path={pairs}",
        f"model.path={folder / 'sft_z1' / 'hf'}",
        "train.max_steps=3",
        "train.micro_batch_size=4",
        "data.max_seq_len=32",
        "runtime.progress_bar=false",
        "runtime.tensorboard=false",
    ]
    config = str(REPO / "configs/dpo.yaml")
    runs.append({"name": "dpo_config", "config": config, "set": shipped + [f"output_dir={folder / 'dpo_config'}"]})
    runs.append(
        {
            "name": "dpo_path_z3",
            "config": config,
            "set": shipped + [f"output_dir={folder / 'dpo_path_z3'}", "deepspeed.zero_stage=3", "train.max_steps=1"],
        }
    )
    other = ["deepspeed.zero_stage=3", "train.max_steps=1", f"model.reference_path={folder / 'sft_z2' / 'hf'}"]
    runs.append(
        {
            "name": "dpo_other_reference",
            "config": config,
            "set": shipped + [f"output_dir={folder / 'dpo_other_reference'}"] + other,
        }
    )
    dpo_split = write_job(folder, "dpo_split", "dpo")
    runs.append({"name": "dpo_split_a", "config": dpo_split, "set": ["checkpoint.every_steps=4", "train.max_steps=4"]})
    runs.append({"name": "dpo_split_b", "config": dpo_split, "set": ["checkpoint.every_steps=4", "train.max_steps=8"]})
    results = launch_plan(folder, runs)
    return folder, results


def losses(folder, name):
    return [record["loss"] for record in metrics(folder, name)]


@pytest.mark.parametrize("name", ["sft_z2", "sft_z3", "seq_z2", "seq_z3"])
def test_loss_falls(trained, name):
    folder, results = trained
    assert results[name]["ok"] and results[name]["step"] == 12
    values = losses(folder, name)
    assert len(values) == 12
    # sft trains only the answer tokens (learnable fast); seq trains every token, random operands
    # included, whose entropy floor is high: so its bar is lower.
    assert sum(values[-3:]) / 3 < (0.8 if name.startswith("sft") else 0.9) * values[0], values
    record = metrics(folder, name)[-1]
    for field in ("step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "elapsed_s"):
        assert field in record
    assert record["lr"] == pytest.approx(5e-3) and record["tokens"] > 0 and record["grad_norm"] > 0


def test_zero_stages_agree(trained):
    folder, _ = trained
    reference = losses(folder, "sft_z1")
    for name in ("sft_z2", "sft_z3"):
        assert losses(folder, name)[:3] == pytest.approx(reference, rel=RTOL), name
    # Steps 2 and 3 come after updates: the optimizer paths of the stages agree too.
    assert reference[1] != reference[0]


def test_accumulation_matches_bigger_micro_batch(trained):
    folder, _ = trained
    split, whole = metrics(folder, "accumulate_2x2"), metrics(folder, "accumulate_4x1")
    assert [r["loss"] for r in split] == pytest.approx([r["loss"] for r in whole], rel=RTOL)
    assert split[0]["grad_norm"] == pytest.approx(whole[0]["grad_norm"], rel=RTOL)
    assert split[0]["tokens"] == whole[0]["tokens"]


@pytest.mark.parametrize("stage", [2, 3])
def test_resume_is_exact(trained, stage):
    folder, results = trained
    assert results[f"split_z{stage}_a"]["step"] == 4 and results[f"split_z{stage}_b"]["step"] == 8
    straight, resumed = metrics(folder, f"straight_z{stage}"), metrics(folder, f"split_z{stage}")
    assert [r["step"] for r in resumed] == list(range(1, 9))  # the log was trimmed/continued, no duplicates
    assert [r["loss"] for r in resumed] == pytest.approx([r["loss"] for r in straight], rel=1e-6, abs=1e-7)
    assert [r["grad_norm"] for r in resumed] == pytest.approx([r["grad_norm"] for r in straight], rel=1e-5)
    assert [r["samples"] for r in resumed] == [r["samples"] for r in straight]
    final = folder / f"split_z{stage}" / "checkpoints" / "step_00000008"
    report = verify_checkpoint(final)
    manifest = json.loads((final / "manifest.json").read_text())
    assert manifest["parts"] == ["policy"] and manifest["step"] == 8 and report.files >= 4
    shard_files = [name for name in manifest["files"] if name.startswith("policy/")]
    assert sum("optim_states" in name for name in shard_files) == 2  # both ranks' ZeRO shards
    state = json.loads((final / "trainer_state.json").read_text())
    assert state["step"] == 8 and state["consumed_samples"] == 8 * 8 and len(state["rng"]) == 2


def test_async_save_trains_the_same_and_its_checkpoints_resume(trained):
    folder, results = trained
    assert results["async_z3"]["ok"] and results["async_z3"]["step"] == 8, results["async_z3"]
    straight, background = metrics(folder, "straight_z3"), metrics(folder, "async_z3")
    assert [r["step"] for r in background] == list(range(1, 9))
    # Training beside a background save is the same training: the same losses and gradient norms.
    assert [r["loss"] for r in background] == pytest.approx([r["loss"] for r in straight], rel=1e-6, abs=1e-7)
    assert [r["grad_norm"] for r in background] == pytest.approx([r["grad_norm"] for r in straight], rel=1e-5)
    checkpoints = folder / "async_z3" / "checkpoints"
    assert sorted(path.name for path in checkpoints.iterdir()) == [f"step_{step:08d}" for step in (2, 4, 6, 8)]
    for step in (2, 4, 6, 8):
        report = verify_checkpoint(checkpoints / f"step_{step:08d}")
        state = json.loads((checkpoints / f"step_{step:08d}" / "trainer_state.json").read_text())
        assert report.step == step and state["step"] == step and len(state["rng"]) == 2
        shards = json.loads((checkpoints / f"step_{step:08d}" / "manifest.json").read_text())["files"]
        assert sum("optim_states" in name for name in shards) == 2  # both ranks' ZeRO-3 shards
    assert results["async_resume"]["ok"] and results["async_resume"]["step"] == 8, results["async_resume"]
    resumed = metrics(folder, "async_resume")
    assert [r["step"] for r in resumed] == [7, 8]
    assert [r["loss"] for r in resumed] == pytest.approx([r["loss"] for r in straight[6:]], rel=1e-6, abs=1e-7)


def test_legacy_deepspeed_folder_resumes(trained):
    folder, results = trained
    assert results["legacy"]["ok"], results["legacy"]
    resumed = metrics(folder, "legacy")
    assert [r["step"] for r in resumed] == [5, 6, 7, 8]
    straight = metrics(folder, "straight_z2")
    assert [r["loss"] for r in resumed] == pytest.approx([r["loss"] for r in straight[4:]], rel=1e-6, abs=1e-7)
    assert "no manifest" in (folder / "launch.log").read_text()


def test_resume_refuses_checkpoint_missing_a_part(trained):
    folder, results = trained
    outcome = results["refuse"]
    assert not outcome["ok"]
    assert "lacks the part(s) policy" in outcome["error"]
    assert not (folder / "refuse" / "metrics.jsonl").exists() or not (folder / "refuse" / "metrics.jsonl").read_text()


def test_dpo_learns_the_preference_under_zero3(trained):
    folder, results = trained
    assert results["dpo_z3"]["ok"], results["dpo_z3"]
    records = metrics(folder, "dpo_z3")
    for field in (
        "loss",
        "rewards_chosen",
        "rewards_rejected",
        "reward_margin",
        "reward_accuracy",
        "logps_chosen",
        "logps_rejected",
    ):
        assert field in records[0]
    # The policy starts equal to the reference: every implicit reward is 0 and the loss is log 2.
    assert records[0]["loss"] == pytest.approx(0.6931, abs=1e-3) and records[0]["reward_margin"] == pytest.approx(
        0, abs=1e-5
    )
    late = records[-4:]
    late_accuracy = sum(r["reward_accuracy"] for r in late) / 4
    # It rises: from 0 (every margin is exactly 0 and accuracy counts chosen > rejected strictly).
    assert records[0]["reward_accuracy"] == 0 and late_accuracy > 0.6
    assert sum(r["loss"] for r in late) / 4 < 0.6
    assert sum(r["reward_margin"] for r in late) / 4 > 0


def test_dpo_precomputed_reference_gives_the_same_run(trained):
    folder, results = trained
    assert results["dpo_z3_precomputed"]["ok"], results["dpo_z3_precomputed"]
    held, precomputed = metrics(folder, "dpo_z3"), metrics(folder, "dpo_z3_precomputed")
    assert [r["loss"] for r in precomputed] == pytest.approx([r["loss"] for r in held], rel=RTOL, abs=1e-6)
    manifest = json.loads((folder / "dpo_z3" / "checkpoints" / "step_00000012" / "manifest.json").read_text())
    assert manifest["parts"] == ["policy"] and "model.init" in manifest["meta"]["reference"]


def test_dpo_resume_is_exact(trained):
    folder, _ = trained
    straight, resumed = metrics(folder, "dpo_straight"), metrics(folder, "dpo_split")
    assert [r["step"] for r in resumed] == list(range(1, 9))
    for field in ("loss", "reward_accuracy", "reward_margin"):
        assert [r[field] for r in resumed] == pytest.approx([r[field] for r in straight], rel=1e-6, abs=1e-7), field
    assert [r["grad_norm"] for r in resumed] == pytest.approx([r["grad_norm"] for r in straight], rel=1e-5)
    assert [r["samples"] for r in resumed] == [r["samples"] for r in straight]


DPO_METRICS = (
    "loss",
    "rewards_chosen",
    "rewards_rejected",
    "reward_margin",
    "reward_accuracy",
    "logps_chosen",
    "logps_rejected",
)


def test_shipped_dpo_config_runs_from_an_sft_export(trained):
    folder, results = trained
    assert results["dpo_config"]["ok"] and results["dpo_config"]["step"] == 3, results["dpo_config"]
    records = metrics(folder, "dpo_config")
    assert [r["step"] for r in records] == [1, 2, 3]
    for record in records:
        assert all(isinstance(record.get(field), float) for field in DPO_METRICS), record
    manifest = json.loads((folder / "dpo_config" / "checkpoints" / "step_00000003" / "manifest.json").read_text())
    assert manifest["meta"]["reference"] == str(folder / "sft_z1" / "hf")  # default reference: the policy's start


@pytest.mark.parametrize("name", ["dpo_config", "dpo_path_z3"])
def test_default_reference_equals_the_policy_start(trained, name):
    """ZeRO-2, then ZeRO-3 where both load partitioned: the reference holds exactly the policy's start."""
    folder, results = trained
    assert results[name]["ok"], results[name]
    first = metrics(folder, name)[0]
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-4) and first["reward_margin"] == pytest.approx(
        0, abs=1e-5
    )
    assert first["logps_chosen"] < 0 and first["logps_rejected"] < 0


def test_reference_path_sets_the_reference(trained):
    folder, results = trained
    assert results["dpo_other_reference"]["ok"], results["dpo_other_reference"]
    first, same_start = metrics(folder, "dpo_other_reference")[0], metrics(folder, "dpo_path_z3")[0]
    # Same policy and pairs as dpo_path_z3, so the policy's log-probs agree; the reference's do not.
    assert first["logps_chosen"] == pytest.approx(same_start["logps_chosen"], rel=1e-5)
    assert abs(first["reward_margin"]) > 1e-3 and first["loss"] != pytest.approx(math.log(2), abs=1e-3)
    manifest = json.loads(
        (folder / "dpo_other_reference" / "checkpoints" / "step_00000001" / "manifest.json").read_text()
    )
    assert manifest["parts"] == ["policy"] and manifest["meta"]["reference"] == str(folder / "sft_z2" / "hf")
