"""Models: the policy (any transformers causal LM), tokenizers, later the critic and reference."""
