"""`model.attn_implementation` (and ASTR_BACKEND) judged before any rank starts against this transformers, this
machine and the model's class (#38); the failure matrix runs the unknown and not-installed names through train.py."""

from __future__ import annotations

import importlib.util

import pytest
from transformers.utils import is_kernels_available, is_torch_flex_attn_available

from astrai.config.schema import ModelConfig
from astrai.models.policy import check_model_config

LLAMA = {"model_type": "llama", "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
         "num_attention_heads": 2, "max_position_embeddings": 32}  # fmt: skip
GPT2 = {"model_type": "gpt2", "n_embd": 16, "n_layer": 1, "n_head": 2, "n_positions": 32}


@pytest.mark.parametrize("name", ["eager", "sdpa", "paged|eager"])
def test_what_every_machine_has_is_accepted(name):
    assert check_model_config(ModelConfig(init=LLAMA, attn_implementation=name)) is None


@pytest.mark.skipif(not is_torch_flex_attn_available(), reason="this torch has no flex attention")
def test_an_implementation_the_model_does_not_support_is_named():
    assert check_model_config(ModelConfig(init=LLAMA, attn_implementation="flex_attention")) is None
    problem = check_model_config(ModelConfig(init=GPT2, attn_implementation="flex_attention"))
    assert problem.startswith("model.attn_implementation: GPT2LMHeadModel does not support 'flex_attention' (usable")


def test_the_environment_wins_and_is_the_key_named():
    problem = check_model_config(ModelConfig(init=LLAMA, attn_implementation="sdpa"), backend="fast")
    assert problem.startswith("ASTR_BACKEND (runtime.environment or the shell): 'fast' is not an attention")
    assert check_model_config(ModelConfig(init=LLAMA, attn_implementation="bogus"), backend="eager") is None


@pytest.mark.skipif(
    importlib.util.find_spec("flash_attn_interface") is not None or is_kernels_available(),
    reason="flash-attn-3 (or the kernels fallback) is installed",
)
def test_a_flash_attention_not_installed_names_its_package():
    problem = check_model_config(ModelConfig(init=LLAMA, attn_implementation="flash_attention_3"))
    assert "'flash_attention_3' is not installed here: its package (flash-attn-3) is not installed" in problem
