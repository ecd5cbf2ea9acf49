"""What the tests of recipes.checks share: a tiny Llama with a Llama-3-sized vocabulary on the data of the
`llama3_data` fixture (tests/recipes/checks/conftest.py), and the error `preflight` raises for it."""

from __future__ import annotations

from pathlib import Path

import pytest

from recipes.checks import preflight as checks
from recipes.config import recipe_from_dict

REPO = Path(__file__).resolve().parents[3]
VOCAB = 128_256


def llama3_recipe(llama3_data, *overrides, data=None):
    """A tiny Llama (vocabulary 128,256) on `data` (default: the built rows): 24 rows, a global batch of 8."""
    base = {"name": "checks", "model": {"config": {"model_type": "llama", "vocab_size": VOCAB, "hidden_size": 16,
                                                   "intermediate_size": 32, "num_hidden_layers": 4,
                                                   "num_attention_heads": 4, "num_key_value_heads": 2,
                                                   "max_position_embeddings": 128},
                                        "tokenizer": llama3_data["tok"], "dtype": "float32"},
            "data": {"train": str(data or llama3_data["data"])},
            "train": {"steps": 3, "micro_batch_size": 4, "out_dir": str(llama3_data["root"] / "run")}}
    return recipe_from_dict(base, list(overrides))


def refused(llama3_data, recipe, world_size=2) -> str:
    with pytest.raises(checks.RecipeCheckError) as err:
        checks.preflight(recipe, world_size, tokenizer=llama3_data["tokenizer"])
    return str(err.value)
