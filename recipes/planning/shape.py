"""A decoder-only model's shape as the cost models read it, from its Hugging Face config (duck-typed:
`text_config` when it has one).

Notation (every cost model's): L layers, hidden h, intermediate I, a attention heads of size d, k KV
heads, vocabulary V.
"""

from __future__ import annotations

from dataclasses import dataclass

from recipes.planning.moe import MoEShape


@dataclass
class Shape:
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def of(cls, config) -> "Shape":
        """The config's shape; a mixture-of-experts model's `intermediate` is the SwiGLU width one token runs
        through (top-k experts + the shared expert; averaged with the dense MLP over the layers when some
        have none: recipes.planning.moe), so FLOPs and SwiGLU activations count its active experts.
        AttributeError when the config has no layer shapes."""
        c = getattr(config, "text_config", None) or config
        heads = c.num_attention_heads
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
        moe = MoEShape.of(c)
        width = c.intermediate_size if moe is None else round(
            moe.sparse_fraction * moe.active_intermediate + (1 - moe.sparse_fraction) * moe.dense_intermediate)
        return cls(c.num_hidden_layers, c.hidden_size, width, heads,
                   getattr(c, "num_key_value_heads", None) or heads, head_dim, c.vocab_size)

    @property
    def largest_matrix(self) -> int:
        """Elements of a layer's largest weight matrix (h x I or h x a d)."""
        return max(self.hidden * self.intermediate, self.hidden * self.heads * self.head_dim)
