"""Per-token estimators of KL(pi || ref) from the log-probs of tokens sampled from pi.

With log_ratio = logp - ref_logp at a token x ~ pi (Schulman, "Approximating KL Divergence", 2020):

    k1 = log_ratio                                   unbiased, can be negative, high variance
    k2 = 0.5 * log_ratio^2                           biased, >= 0, low variance
    k3 = exp(-log_ratio) - (-log_ratio) - 1          unbiased, >= 0, low variance
       = (r - 1) - log r  with r = ref(x) / pi(x)

E_{x~pi}[k1] = E_{x~pi}[k3] = KL(pi || ref) exactly; k2 is a second-order approximation.

What matters for training is the gradient, and that depends on where the estimate goes
(tests/unit/algos/test_kl_gradients.py checks each line exactly over a small categorical):

  placement                      gradient reaching pi, in expectation over x ~ pi
  in the reward (frozen, score   k1: grad KL(pi || ref)                        exact
  function: E[k(x) grad log pi]) k2: second order in (pi - ref): ~0 near ref   no KL's gradient
                                 k3: grad [KL(pi || ref) - KL(ref || pi)]      ~0 near ref: wrong
  in the loss (pathwise:         k1: 0                                         useless
  E[grad k(x)])                  k2: grad KL(pi || ref)                        exact
                                 k3: grad KL(ref || pi)                        = grad KL(pi || ref) to first order

Hence: k1 in the reward (InstructGPT, TRL, OpenRLHF, verl's defaults), k3 (GRPO's choice) or k2
in the loss; the strategies refuse k1 as a loss term.

Clamping (our addition, off by default): `max_log_ratio=c` clamps log_ratio to [-c, c] before
the estimator. k3 holds exp(-log_ratio), which overflows float32 past |log_ratio| ~ 88 and
already dominates a loss for log_ratio << -10; c = 10 (OpenRLHF's choice) is a sane setting.
Where the clamp binds the estimate is biased and its gradient is zero.
"""

import torch

KL_KINDS = ("k1", "k2", "k3")


def _log_ratio(logp: torch.Tensor, ref_logp: torch.Tensor, max_log_ratio: float | None) -> torch.Tensor:
    log_ratio = logp - ref_logp
    if max_log_ratio is not None:
        if not max_log_ratio > 0:
            raise ValueError(f"max_log_ratio must be > 0, got {max_log_ratio}")
        log_ratio = log_ratio.clamp(-max_log_ratio, max_log_ratio)
    return log_ratio


def kl_k1(logp: torch.Tensor, ref_logp: torch.Tensor, *, max_log_ratio: float | None = None) -> torch.Tensor:
    """k1 = logp - ref_logp. logp, ref_logp: [batch, seq_len] (any shape); returns the same shape."""
    return _log_ratio(logp, ref_logp, max_log_ratio)


def kl_k2(logp: torch.Tensor, ref_logp: torch.Tensor, *, max_log_ratio: float | None = None) -> torch.Tensor:
    """k2 = 0.5 * (logp - ref_logp)^2. logp, ref_logp: [batch, seq_len]; returns the same shape."""
    return 0.5 * _log_ratio(logp, ref_logp, max_log_ratio) ** 2


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor, *, max_log_ratio: float | None = None) -> torch.Tensor:
    """k3 = exp(ref_logp - logp) - (ref_logp - logp) - 1, always >= 0.

    logp, ref_logp: [batch, seq_len]; returns the same shape. Computed with expm1 so that small
    log-ratios keep their precision, and clamped at 0 against rounding below it.
    """
    reverse_log_ratio = -_log_ratio(logp, ref_logp, max_log_ratio)
    return (torch.expm1(reverse_log_ratio) - reverse_log_ratio).clamp_min(0.0)


def kl_estimate(
    logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "k3", *, max_log_ratio: float | None = None
) -> torch.Tensor:
    """Per-token KL estimate of the given `kind` ("k1", "k2" or "k3"); same shape as logp."""
    if kind == "k1":
        return kl_k1(logp, ref_logp, max_log_ratio=max_log_ratio)
    if kind == "k2":
        return kl_k2(logp, ref_logp, max_log_ratio=max_log_ratio)
    if kind == "k3":
        return kl_k3(logp, ref_logp, max_log_ratio=max_log_ratio)
    raise ValueError(f"kind must be one of {KL_KINDS}, got {kind!r}")
