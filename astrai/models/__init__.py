"""Models: the policy (any transformers causal LM), the online_ppo critic (`value.ValueModel`), tokenizers."""
