"""SMMD, smooth maximum mean discrepancy between the numeric distribution and the one-hot target.

With `p` renormalised over the numeric tokens, `q` the one-hot target and `r = p - q`:
`L_MMD = rᵀ K r` for a kernel K over the token values, and `L_smooth = rᵀ (diag(K·1) - K) r`, the
graph-Laplacian energy of r on the kernel graph. Per position `relu(L_MMD + α L_smooth)`, mean over
numeric positions. K and its degrees are built once per vocabulary and kept on the device.

r is formed explicitly rather than expanding `pᵀKp - 2(Kp)_y + K_yy`: the same single [M,N]x[N,N]
product, without the cancellation of three O(1) terms when p is close to q.
"""

from __future__ import annotations

import torch

from ..logit_stats import LogitStats
from ..vocab import NumericVocab, squash_distances
from .common import mean_or_zero

MODES = ("smmd", "mmd", "smooth")
KERNELS = ("gaussian", "laplace")


def smmd_kernel(vocab: NumericVocab, sigmas=(2.0,), squash_factor: float | None = 9.0, kernel: str = "gaussian"):
    """[N, N] K = mean over σ of exp(-D²/(2σ²)) (or exp(-D/σ)), D the (squashed) value distances; CPU fp64."""
    if kernel not in KERNELS:
        raise ValueError(f"smmd: kernel must be one of {KERNELS}, got {kernel!r}")
    if len(sigmas) == 0 or any(s <= 0 for s in sigmas):
        raise ValueError(f"smmd: sigmas must be a non-empty list of positive numbers, got {sigmas!r}")
    distances = squash_distances((vocab.values[:, None] - vocab.values[None, :]).abs(), squash_factor)
    if kernel == "gaussian":
        kernels = [torch.exp(-distances.square() / (2 * s * s)) for s in sigmas]
    else:
        kernels = [torch.exp(-distances / s) for s in sigmas]
    return torch.stack(kernels).mean(0)


def smmd_term(
    stats: LogitStats,
    vocab: NumericVocab,
    sigmas=(2.0,),
    squash_factor: float | None = 9.0,
    kernel: str = "gaussian",
    alpha: float | None = None,
    mode: str = "smmd",
    denominator: float | None = None,
) -> torch.Tensor:
    """SMMD over the numeric positions. `alpha` None is `1 / (2 · mean degree of K)`. `denominator`:
    the step's numeric positions (`numloss.normalization`); default this batch's."""
    if mode not in MODES:
        raise ValueError(f"smmd: mode must be one of {MODES}, got {mode!r}")
    sigmas = tuple(float(s) for s in sigmas)
    num = stats.numeric
    device = num.logits.device
    key = ("smmd_kernel", sigmas, squash_factor, kernel)
    kernel_cpu = vocab.memo(key, lambda: smmd_kernel(vocab, sigmas, squash_factor, kernel))
    K = vocab.cached(key, device, torch.float32, lambda: kernel_cpu)
    degree = vocab.cached(key + ("degree",), device, torch.float32, lambda: kernel_cpu.sum(1))
    if alpha is None:
        alpha = vocab.memo(key + ("alpha",), lambda: float(1.0 / (2.0 * kernel_cpu.sum(1).mean())))

    r = torch.softmax(num.logits, dim=-1).scatter_add(
        1, num.target[:, None], torch.full_like(num.target[:, None], -1.0, dtype=num.logits.dtype)
    )
    mmd = (r * (r @ K)).sum(dim=-1)  # K is symmetric
    if mode == "mmd":
        per_position = mmd
    else:
        smooth = (degree * r.square()).sum(dim=-1) - mmd
        per_position = alpha * smooth if mode == "smooth" else mmd + alpha * smooth
    return mean_or_zero(torch.relu(per_position), denominator=denominator)
