"""One prefill per prompt group (`rollout.share_prefill`): a rollout samples `group_size` responses to each
prompt, and plain `generate` (TRL's too) prefills every copy of the prompt: group_size times the prompt's
forward for one prompt's worth of keys and values. Here the distinct prompts run one forward, their KV cache
is repeated to the group (`Cache.batch_repeat_interleave`), and generate resumes from it.

How generate resumes: it takes a cache (`cache=`, transformers 5) and the FULL input_ids and attention mask,
and feeds only the positions the cache lacks. The cache holds every prompt position but the last, so
generate's first forward is the last prompt token against the cache, and from there on everything is
generate's own: the logits processors (the rollout's `TokenSampler`, so temperature, top_k, top_p and the
vocabulary cut), EOS stopping, max_new_tokens, padding of finished rows, synced_gpus. The RNG stream is
consumed identically (the prefill draws nothing: eval mode, and the sampler draws one uniform per row per
step, as before), so the same seed draws the same uniforms.

What differs from the unshared path, numerically: (1) the last prompt token's logits come from a one-token
forward against the cache instead of the full-prompt forward (the cached-vs-full kernel difference every
decoding step already has, ~1e-7 in fp32), and (2) the prompt's keys and values come from a forward over
B = N / group_size rows instead of N, which a CPU GEMM may block differently. Either can move a logit by a
few ulps; a sampled token changes only if its uniform falls within that distance of a cumulative-probability
boundary (odds ~1e-7 per token in fp32), and the behaviour log-probs recomputed by the training forward
(`recompute`) do not see the cache at all. Position ids follow generate's own rule (cumulative sum of the
attention mask, pads at 0), so left-padded prompts of different lengths land where they did.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from astrai.models.policy import causal_lm, forward_parameters


def shares_prefill(settings, group_size: int, prompt_ids: torch.Tensor, model, *, synced: bool) -> bool:
    """Whether this rollout prefills once per prompt group: `rollout.share_prefill` on, groups of 2 or more,
    prompts of at least 2 columns (the cache holds all but the last), and a model generate gives a
    `DynamicCache` (not a recurrent one such as Mamba's). prompt_ids: [N, P], this rank's prompt rows.
    synced: every rank's forwards are collectives (ZeRO-3 `gather`), so every rank must make the same
    choice: the ranks agree (all share, or none does)."""
    supports_cache = getattr(model, "_supports_default_dynamic_cache", lambda: True)()
    share = bool(getattr(settings, "share_prefill", True)) and group_size > 1 and prompt_ids.shape[1] > 1
    share = share and supports_cache
    if synced:
        agreed = torch.tensor([int(share)], device=prompt_ids.device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
        share = bool(agreed.item())
    return share


@torch.no_grad()
def group_prefill_cache(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, group_size: int):
    """The KV cache of every prompt position but the last, computed once per group and repeated to it.

    prompt_ids, prompt_mask: [N, P] left-padded, N = groups x group_size, each group's rows identical (as
    `generate_rollout` lays them out). Returns a transformers `DynamicCache` of N rows and P - 1 positions,
    for `model.generate(input_ids=prompt_ids, attention_mask=prompt_mask, cache=...)`."""
    from transformers import DynamicCache

    distinct_ids, distinct_mask = prompt_ids[::group_size], prompt_mask[::group_size]
    if not (
        torch.equal(distinct_ids.repeat_interleave(group_size, dim=0), prompt_ids)
        and torch.equal(distinct_mask.repeat_interleave(group_size, dim=0), prompt_mask)
    ):
        raise ValueError(
            f"share_prefill: the prompt rows are not {prompt_ids.shape[0] // group_size} groups of "
            f"{group_size} identical rows"
        )
    prefix_ids, prefix_mask = distinct_ids[:, :-1], distinct_mask[:, :-1]
    accepted = forward_parameters(type(causal_lm(model)))
    inputs = {"input_ids": prefix_ids, "attention_mask": prefix_mask, "use_cache": True}
    if "position_ids" in accepted:  # generate's own rule (_prepare_position_ids_for_generation): pads at 0
        inputs["position_ids"] = (prefix_mask.long().cumsum(-1) - 1).masked_fill(prefix_mask == 0, 0)
    if "logits_to_keep" in accepted:  # no LM head over the whole prompt
        inputs["logits_to_keep"] = 1
    cache = DynamicCache(config=model.config.get_text_config(decoder=True))
    model(cache=cache, **inputs)
    cache.batch_repeat_interleave(group_size)
    return cache
