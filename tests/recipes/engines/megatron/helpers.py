"""Shared by tests/recipes/engines/megatron: tiny HF models saved to disk (fixed seeds, so every run starts from the same
weights), recipes that point at them, and a process spawner with a timeout."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.distributed import run_ranks  # noqa: F401  (the tests import it from here)

VOCAB = 300  # padded to 384 at TP 1 and to 512 at TP 2 (Megatron's multiple of 128 x tp)
LLAMA = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
             "num_key_value_heads": 2, "max_position_embeddings": 64, "tie_word_embeddings": True, "rope_theta": 500000.0,
             # Llama-3 scaling with a short original context, so the scaled band covers real positions
             "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 16}}
QWEN2 = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "max_position_embeddings": 64, "tie_word_embeddings": False, "rope_theta": 10000.0}
# head_dim 32, not hidden / heads = 16 (Qwen3-0.6B too: 128 vs 64); YaRN with a short original context, so
# the ramp falls inside the head and attention_factor (1 + 0.1 ln 4) scales the scores
QWEN3 = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 64, "tie_word_embeddings": False,
         "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                             "original_max_position_embeddings": 16}}
CONFIGS = {"llama": LLAMA, "qwen2": QWEN2, "qwen3": QWEN3}


def save_tiny(kind: str, out: str | Path, seed: int = 0, **overrides) -> Path:
    """A random-weight tiny `kind` ("llama": tied, 4 layers, GQA, Llama-3 rope; "qwen2": QKV bias,
    untied; "qwen3": q/k norms, head_dim 32, YaRN, untied), its config changed by `overrides`, saved as
    several safetensors shards with their index. Biases and norms get random values (HF initialises them
    to zero and one, which would hide a misplaced one)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    out = Path(out)
    if (out / "config.json").is_file():
        return out
    torch.manual_seed(seed)
    config = AutoConfig.for_model(kind, **{**CONFIGS[kind], **overrides})
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.copy_(torch.randn_like(p) * 0.1 + (1.0 if "norm" in name else 0.0))
    model.save_pretrained(str(out), max_shard_size="60KB")
    return out


def recipe_for(model_dir: str | Path, tp: int = 1, pp: int = 1, vp: int | None = None, sp: bool = False):
    from recipes.config import Recipe
    from recipes.engines.megatron.pure.contract import MegatronSection
    from recipes.sections import ModelConfig

    return Recipe(model=ModelConfig(name_or_path=str(model_dir), dtype="float32"),
                  megatron=MegatronSection(tp_size=tp, pp_size=pp, virtual_pp_size=vp, sequence_parallel=sp))


