"""`model.attn_implementation` (or `ASTR_BACKEND`) judged before any rank starts.

transformers checks the name only while it builds the model, on every rank, and raises from deep inside
`from_config` / `from_pretrained`. Here the name is checked against what this transformers offers
(`eager` and its `ALL_ATTENTION_FUNCTIONS`), what is installed on this machine (the FlashAttention packages,
torch's flex attention) and what the model's class supports (`_supports_sdpa`, `_supports_flash_attn`, ...).
Whether a GPU can run an installed FlashAttention is left to transformers, at build time: the launcher and
`python -m astrai plan` read the job on machines that need not have one.
"""

from __future__ import annotations

# The pip distribution of each FlashAttention version, for the message (transformers' compatibility matrix).
FLASH_PACKAGES = {2: "flash-attn", 3: "flash-attn-3", 4: "flash-attn-4"}
# The class attribute saying whether a model supports an implementation (eager: every model).
SUPPORT_FLAGS = {"sdpa": "_supports_sdpa", "flex_attention": "_supports_flex_attn"}


def offered_implementations() -> list[str]:
    """Every attention implementation this transformers knows by name."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    # astrai_*: AstrAI's own registrations (models/segment_attention.py), chosen by data.packing, not by this key
    return ["eager", *sorted(name for name in ALL_ATTENTION_FUNCTIONS.valid_keys() if not name.startswith("astrai_"))]


def missing_package(name: str) -> str | None:
    """Why `name` cannot run on this machine (its package is not importable), or None when it can."""
    from transformers.modeling_flash_attention_utils import FLASH_ATTENTION_COMPATIBILITY_MATRIX
    from transformers.utils import is_kernels_available, is_torch_flex_attn_available

    if name.startswith("flash_attention_") and name[-1].isdigit():
        version = int(name[-1])
        facts = FLASH_ATTENTION_COMPATIBILITY_MATRIX.get(version)
        # Without the package transformers falls back to a Hub kernel through the `kernels` package, when installed.
        if facts is not None and not facts["pkg_availability_check"]() and not is_kernels_available():
            return f"its package ({FLASH_PACKAGES.get(version, 'flash-attn')}) is not installed"
    if name == "flex_attention" and not is_torch_flex_attn_available():
        return "this torch has no flex attention"
    return None


def model_class(config):
    """The causal-LM class transformers builds for `config` (None for a class it cannot name: remote code)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM._model_mapping.get(type(config), None)


def supports(cls, name: str) -> bool:
    if cls is None or name in ("eager", "paged|eager"):
        return True
    if name.startswith("flash_attention_"):
        return bool(getattr(cls, "_supports_flash_attn", False) or getattr(cls, "_supports_flash_attn_2", False))
    return bool(getattr(cls, SUPPORT_FLAGS.get(name, ""), True))


def attention_problem(name: str, config, key: str) -> str | None:
    """What is wrong with attention implementation `name` for a model of `config` (one line starting with
    `key`), or None when nothing is."""
    import transformers

    if "/" in name:  # a Hub kernel (`kernels-community/flash-attn2`): transformers loads it through `kernels`
        from transformers.utils import is_kernels_available

        return None if is_kernels_available() else f"{key}: {name!r} is a Hub kernel: it needs the kernels package"
    offered = offered_implementations()
    requested = name if name == "paged|eager" else name.removeprefix("paged|")  # transformers drops the prefix
    cls = model_class(config)
    usable = [item for item in offered if missing_package(item) is None and supports(cls, item)]
    if requested not in offered:
        return (
            f"{key}: {name!r} is not an attention implementation of transformers {transformers.__version__} (it "
            f"offers {', '.join(offered)}; usable here: {', '.join(usable)})"
        )
    reason = missing_package(requested)
    if reason is not None:
        return f"{key}: {name!r} is not installed here: {reason} (usable here: {', '.join(usable)})"
    if not supports(cls, requested):
        return f"{key}: {cls.__name__} does not support {name!r} (usable here: {', '.join(usable)})"
    return None
