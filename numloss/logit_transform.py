"""What a model does to its logits after the LM head's matmul, for the paths that compute logits from
hidden states themselves (`numloss.chunked_head`, the Trainer integration): a scale, then a soft cap.

    z = s · x                                  (Granite: s = 1 / logits_scaling; Cohere: s = logit_scale)
    z = c · tanh(s · x / c)                    (Gemma-2/3: c = final_logit_softcapping)

The model's own forward applies these to its logits, so a loss on `model(...).logits` sees them already;
a head that multiplies hidden states by the lm_head weight itself must apply them too, or its CE and
every term are those of another model. The derivative needs no stored input: dz/dx = s · (1 - (z / c)²).

`LogitTransform.from_model_config(config)` reads a Hugging Face config (duck-typed: numloss imports no
transformers) with the rules the models' forwards use: `final_logit_softcapping` (Gemma-2/3, and any model
that sets it); the scale from `logit_scale` (Cohere), `output_multiplier`, `lm_head_multiplier`
(Falcon-H1), or `logits_scaling` (divided by: Granite, MiniCPM3; multiplied by: HyperCLOVA X).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LogitTransform:
    """`z = softcap · tanh(scale · x / softcap)` (no tanh when `softcap` is None)."""

    scale: float = 1.0
    softcap: float | None = None

    def __post_init__(self):
        if not (isinstance(self.scale, (int, float)) and math.isfinite(self.scale)):
            raise ValueError(f"logit scale must be a finite number, got {self.scale!r}")
        if self.softcap is not None and not (isinstance(self.softcap, (int, float)) and math.isfinite(self.softcap)
                                             and self.softcap > 0):
            raise ValueError(f"logit soft cap must be a finite number > 0 (or None), got {self.softcap!r}")

    @property
    def identity(self) -> bool:
        return self.scale == 1.0 and self.softcap is None

    @classmethod
    def from_model_config(cls, config) -> "LogitTransform":
        """The transform a Hugging Face model's forward applies to its LM head's output (see the module
        docstring); the identity for a model without one. `config`: the model's config (its text config is
        read where it has one) or None."""
        if config is None:
            return cls()
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        softcap = getattr(text, "final_logit_softcapping", None)
        scale = None
        for key in ("logit_scale", "output_multiplier", "lm_head_multiplier"):
            if getattr(text, key, None) is not None:
                scale = float(getattr(text, key))
                break
        if scale is None and getattr(text, "logits_scaling", None) is not None:
            scaling = float(text.logits_scaling)
            scale = scaling if getattr(text, "model_type", None) == "hyperclovax" else 1.0 / scaling
        return cls(scale=1.0 if scale is None else scale, softcap=None if softcap is None else float(softcap))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """A new tensor: the transformed `logits` (any shape and dtype, computed in fp32, returned in fp32),
        differentiable (the in-place `apply_` is for buffers outside autograd)."""
        z = logits.float() * self.scale if self.scale != 1.0 else logits.float()
        return z if self.softcap is None else torch.tanh(z / self.softcap) * self.softcap

    def apply_(self, x: torch.Tensor, derivative: torch.Tensor | None = None) -> torch.Tensor:
        """Transform the fp32 tensor `x` in place and return it. `derivative` (x's shape, fp32, only with a
        soft cap): filled with dz/dx, which the backward multiplies the gradient by (without a soft cap
        the derivative is the constant `scale`)."""
        if self.scale != 1.0:
            x.mul_(self.scale)
        if self.softcap is not None:
            x.div_(self.softcap).tanh_()
            if derivative is not None:  # s · (1 - tanh²), from tanh itself
                torch.mul(x, x, out=derivative).neg_().add_(1.0).mul_(self.scale)
            x.mul_(self.softcap)
        return x


IDENTITY = LogitTransform()
