"""pass@k: the chance that at least one of k answers drawn from n sampled ones is correct.

The unbiased estimator of Chen et al. 2021 (Codex, eq. 1), for a prompt with n sampled answers of
which c are correct:

    pass@k = 1 - C(n - c, k) / C(n, k) = 1 - prod_{i = n - c + 1}^{n} (1 - k / i)

(1 when n - c < k: every draw of k holds a correct answer). The product form avoids the huge binomials.
"""

from __future__ import annotations

import torch


def pass_at_k(correct: torch.Tensor, samples: int, k: int) -> torch.Tensor:
    """Per-prompt unbiased pass@k [P] (float64) from the correct answer counts `correct` [P] (integers in
    0..samples) of `samples` answers per prompt; needs 1 <= k <= samples."""
    if not 1 <= k <= samples:
        raise ValueError(f"pass@k needs 1 <= k <= samples, got k={k}, samples={samples}")
    correct = correct.to(torch.float64)
    if bool(((correct < 0) | (correct > samples)).any()):
        raise ValueError(f"correct counts must lie in 0..{samples}")
    index = torch.arange(1, samples + 1, dtype=torch.float64)  # i = 1..n
    # factor_i = 1 - k / i for the i in (n - c, n], 1 elsewhere; rows with n - c < k give a factor 0 (i = k).
    in_range = index[None, :] > (samples - correct)[:, None]
    factors = torch.where(in_range, 1.0 - k / index[None, :], torch.ones((), dtype=torch.float64))
    return 1.0 - factors.prod(dim=1)
