"""RoPE as the HF config defines it, reproduced by the Megatron engine: the inverse frequencies written into
the built GPTModel (`model.set_rope_frequencies`) and, for YaRN, the scale of the attention scores.

megatron-core's own `rope_scaling` hard-codes Llama 3.1's constants (factor 8, original context 8192), so
the engine computes the frequencies from the HF config instead. The kinds transformers 5 can carry
(`rope_parameters["rope_type"]`, its `ROPE_INIT_FUNCTIONS`) and what becomes of each:

- `default`, `linear`, `llama3`: frequencies only.
- `yarn` (Qwen2.5 / Qwen3 long context): frequencies, and HF multiplies cos and sin by `attention_factor`
  on q and k alike, so every attention score by attention_factor². The engine puts that into the scores'
  scale (`TransformerConfig.softmax_scale` = attention_factor² / sqrt(head_dim), `attention_score_scale`),
  which both layer specs honour. megatron's own YaRN `mscale` is not used: megatron-core 0.16.1's fused
  THD RoPE (Transformer Engine, packed rows) drops it.
- `dynamic`, `longrope`: refused. HF recomputes their frequencies from each batch's length (dynamic NTK
  past `max_position_embeddings`; longrope's short or long factors past the original context), which a
  model with frequencies fixed at build time cannot follow.
- anything else (`proportional`, a kind added later) and `partial_rotary_factor` other than 1 (megatron
  rotates the whole head here): refused.

Pure: no communication, no megatron import.
"""

from __future__ import annotations

import math

import torch

from ..pure.support import rope_settings


def rope_inv_freq(hf_config, kv_channels: int) -> torch.Tensor:
    """The RoPE inverse frequencies `[d/2]` (fp32) the HF model uses, computed as transformers does (the
    same operations in the same order: bit for bit)."""
    theta, scaling = rope_settings(hf_config)
    inv = 1.0 / (theta ** (torch.arange(0, kv_channels, 2, dtype=torch.int64).float() / kv_channels))
    if scaling is None:
        return inv
    if scaling["rope_type"] == "yarn":
        return _yarn_inv_freq(hf_config, scaling, theta, kv_channels)
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "linear":
        return inv / factor
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old / low, inv / factor, inv)  # long wavelengths: divided by factor
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / high) & ~(wavelen > old / low)
    return torch.where(medium, smoothed, scaled)


def attention_score_scale(hf_config, kv_channels: int) -> float | None:
    """The attention scores' scale when RoPE changes it (YaRN: attention_factor² / sqrt(d), see the module
    docstring), else None (megatron's 1 / sqrt(d), as HF)."""
    _, scaling = rope_settings(hf_config)
    if scaling is None or scaling["rope_type"] != "yarn":
        return None
    factor = _yarn_attention_factor(hf_config, scaling)
    return None if factor == 1.0 else factor * factor / math.sqrt(kv_channels)


def _yarn_factor(hf_config, scaling: dict) -> tuple[float, float]:
    """(factor, original context) of a YaRN config; a missing factor is max / original positions (as HF)."""
    original = scaling.get("original_max_position_embeddings") or hf_config.max_position_embeddings
    factor = scaling.get("factor")
    return (hf_config.max_position_embeddings / original if factor is None else float(factor)), original


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_attention_factor(hf_config, scaling: dict) -> float:
    """HF's `attention_factor`: stated, else from `mscale` / `mscale_all_dim`, else 0.1 ln(factor) + 1."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor, _ = _yarn_factor(hf_config, scaling)
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim))
    return _yarn_mscale(factor)


def _yarn_inv_freq(hf_config, scaling: dict, base: float, dim: int) -> torch.Tensor:
    """YaRN's frequencies: interpolated (divided by factor) below the correction range, extrapolated
    (unchanged) above it, a linear ramp between (transformers' `_compute_yarn_parameters`)."""
    factor, original = _yarn_factor(hf_config, scaling)
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # HF's guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation = 1 - ramp
    return 1.0 / (factor * pos_freqs) * (1 - extrapolation) + 1.0 / pos_freqs * extrapolation
