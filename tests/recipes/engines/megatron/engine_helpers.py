"""A tiny backbone, recipes and global batches for the Megatron engine's multi-process tests.

Every layout starts from the same weights: a random tiny Llama (4 layers, hidden 64, tied embeddings,
GQA) saved once as a Hugging Face checkpoint and converted by each rank for its layout
(`build_gpt_model`). Its vocabulary (300) is padded by Megatron to 384 at TP 1 and to 512 at TP 2
(multiples of 128 x TP): layouts agree only if the padded columns stay out of the loss. The global
batch of a step is fixed (rows of digits and text, prompts and right padding); each data-parallel
replica takes a contiguous block of its rows and splits it into `grad_accum` micro-batches, so every
layout and split trains on the same rows.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

VOCAB, ROWS, SEQ = 300, 8, 16  # ROWS: the global batch


def digits_tokenizer(root: Path):
    """The engine tests' digits tokenizer (120 tokens), trained offline into `root / "tokenizer"`."""
    from recipes.experiments.tiny import train_tokenizer

    texts = [f"the sum of {i} and {3 * i + 7} is {4 * i + 7} . what is the answer" for i in range(60)]
    return train_tokenizer(texts, root / "tokenizer", style="digits", vocab_size=120)


def gloo_rank_runtime(rank: int, world: int):
    """In a spawned test rank: the torchrun environment, DeepSpeed's process group on gloo, and the
    engines' `Runtime` for this CPU rank."""
    import os

    os.environ.update(DS_ACCELERATOR="cpu", RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1")
    from recipes.engines.deepspeed.runtime.distributed import skip_cpu_shm_op
    from recipes.training.runtime import Runtime

    skip_cpu_shm_op()  # DeepSpeed's CPU accelerator would compile an op for inference only (35-65 s)
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo", dist_init_required=False)
    return Runtime(rank, world, rank, torch.device("cpu"))


def make_assets(root: Path) -> dict[str, str]:
    """A digits tokenizer and a tiny random Llama (seed 0) saved in `root`; returns their paths."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    tokenizer = digits_tokenizer(root)
    assert len(tokenizer) <= VOCAB
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(str(root / "model"), max_shard_size="200KB")  # sharded, with an index
    return {"tokenizer": str(root / "tokenizer"), "model": str(root / "model")}


def make_recipe(assets: dict, *, tp: int = 1, pp: int = 1, vpp: int | None = None, sp: bool = False,
                micro: int = 2, accum: int = 1, steps: int = 3, dtype: str = "float32", lr: float = 3e-3,
                pad: int = 1):
    """`pad`: data.pad_to_multiple_of (1: each micro-batch exactly as long as its longest row, so the
    rows' 13-16 tokens give micro-batches of different lengths)."""
    from recipes.config import recipe_from_dict

    return recipe_from_dict({
        "name": "megatron-test",
        "model": {"name_or_path": assets["model"], "tokenizer": assets["tokenizer"], "dtype": dtype},
        "data": {"train": "unused", "pad_to_multiple_of": pad},
        "loss": {"objective": {"terms": {"smmd": {}, "ntl_was": {}, "ntil": {"noise_scale": 0.0},
                                         "dist2": {"weighting": "place_value"}}}},
        # clip at 1.0 with a large lr: the clip and the schedule both act within 3 steps
        "optim": {"lr": lr, "weight_decay": 0.1, "warmup_steps": 1, "grad_clip": 1.0},
        "megatron": {"tp_size": tp, "pp_size": pp, "virtual_pp_size": vpp, "sequence_parallel": sp,
                     "distributed_optimizer": False},
        "train": {"engine": "megatron", "steps": steps, "micro_batch_size": micro, "grad_accum": accum,
                  "out_dir": "unused", "export": False},
    })


def global_batch(step: int, tokenizer_dir: str) -> list[dict[str, torch.Tensor]]:
    """The `ROWS` rows of step `step` (1-based), each a dict of `[SEQ]` tensors as the loop gives them."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    g = torch.Generator().manual_seed(1000 + step)
    digits = torch.tensor([tok.convert_tokens_to_ids(str(d)) for d in range(10)])
    rows = []
    for r in range(ROWS):
        ids = torch.randint(3, len(tok), (SEQ,), generator=g)
        start = int(torch.randint(4, 8, (1,), generator=g))
        ids[start:start + 3] = digits[torch.randint(10, (3,), generator=g)]  # a three-digit number
        real = SEQ - int(torch.randint(0, 4, (1,), generator=g))  # right padding
        ids[real:] = tok.pad_token_id
        labels = ids.clone()
        labels[:3] = -100  # a prompt
        labels[real:] = -100
        mask = (torch.arange(SEQ) < real).long()
        rows.append({"input_ids": ids, "labels": labels, "attention_mask": mask})
    return rows


def replica_window(step: int, tokenizer_dir: str, dp_rank: int, dp_size: int, micro: int) -> list[dict]:
    """Data-parallel replica `dp_rank`'s micro-batches of step `step`."""
    rows = global_batch(step, tokenizer_dir)
    per_replica = ROWS // dp_size
    mine = rows[dp_rank * per_replica:(dp_rank + 1) * per_replica]
    return [{k: torch.stack([row[k] for row in mine[i:i + micro]]) for k in mine[0]}
            for i in range(0, per_replica, micro)]


def packed_and_unpacked(tokenizer_dir: str) -> dict[str, list[dict]]:
    """Two examples (7 and 6 tokens, from step 1's first two rows) as one-micro-batch windows: packed
    into one row (segment ids 1, 2 and 0 on padding; positions restart; the second example's first
    label ignored, as data_prep makes packed rows) and unpacked (two right-padded rows)."""
    first, second = global_batch(1, tokenizer_dir)[:2]
    a, b = {k: v[:7] for k, v in first.items()}, {k: v[:6] for k, v in second.items()}
    b["labels"] = b["labels"].clone()
    b["labels"][0] = -100
    pad = SEQ - 13
    packed = {"input_ids": torch.cat([a["input_ids"], b["input_ids"], torch.zeros(pad, dtype=torch.long)]),
              "labels": torch.cat([a["labels"], b["labels"], torch.full((pad,), -100)]),
              "attention_mask": torch.cat([torch.ones(13, dtype=torch.long), torch.zeros(pad, dtype=torch.long)]),
              "position_ids": torch.cat([torch.arange(7), torch.arange(6), torch.arange(pad)]),
              "sequence_ids": torch.cat([torch.full((7,), 1), torch.full((6,), 2), torch.zeros(pad, dtype=torch.long)])}

    def padded(example: dict) -> dict:
        n = len(example["input_ids"])
        return {"input_ids": torch.cat([example["input_ids"], torch.zeros(SEQ - n, dtype=torch.long)]),
                "labels": torch.cat([example["labels"], torch.full((SEQ - n,), -100)]),
                "attention_mask": (torch.arange(SEQ) < n).long()}

    unpacked = [padded(a), padded(b)]
    return {"packed": [{k: v[None] for k, v in packed.items()}],
            "unpacked": [{k: torch.stack([row[k] for row in unpacked]) for k in unpacked[0]}]}


def run_steps(engine, assets: dict, first: int, last: int, diagnostics: bool = False) -> list[dict[str, float]]:
    """Train steps `first..last`; returns each step's logged row (summed over the data-parallel group,
    as the loop logs it) with its grad_norm and the lr it used. `diagnostics`: the step also computes the
    per-term gradient sums, finished into the row's grad/<part>/* values and `clipped` as the loop does
    (`recipes.training.diagnostics.finish_row`)."""
    import torch.distributed as dist

    from recipes.training.diagnostics import finish_row

    rows = []
    for s in range(first, last + 1):
        lr = engine.lr()
        window = replica_window(s, assets["tokenizer"], engine.dp.rank, engine.dp.size,
                                engine.recipe.train.micro_batch_size)
        out = engine.train_step(window, diagnostics=diagnostics)
        norm = engine.grad_norm()
        keys = sorted(out)
        total = torch.tensor([out[k] for k in keys], dtype=torch.float64)
        dist.all_reduce(total, group=engine.dp.group)
        row = {**dict(zip(keys, total.tolist())), "grad_norm": norm, "lr": lr}
        rows.append(finish_row(row, engine.recipe.optim.grad_clip) if diagnostics else row)
    return rows


def write(path: Path, value) -> None:
    path.write_text(json.dumps(value))


def read(path: Path):
    return json.loads(Path(path).read_text())
