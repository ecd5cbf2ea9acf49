"""DeepSpeed-Ulysses on the DeepSpeed engine (`deepspeed.sp_size`): `recipes.train` at sp 2 on 2 ranks logs the
losses, every term's value and the gradient norm of sp 1 on 1 rank (steps 1-3, 1e-4 relative), on arithmetic
rows whose numbers straddle the split (NTIL's exchange of straddling runs is counted on the ranks: it must
run): ZeRO-3 with grad accumulation (2 x 2 against 4 x 1 at ZeRO-2), ZeRO-2 with the chunked head, and
sp 2 x dp 2 on 4 ranks (1 x 2 per replica). The objective holds CE's
replacement GCE and every other term (SMMD, NTL-WAS, NTL-MSE, DIST2 in its code mode, NTIL, DEL).

A checkpoint saved at sp 2 resumes at sp 1 (ZeRO's state through the universal conversion) onto the sp 1
curve. The runs are calls of `recipes.train.main` inside ranks this test starts (`tests.distributed.run_ranks`),
not torchrun jobs. The refusals (AutoTP with sp, eager attention, heads sp does not divide, packed rows,
held-out evaluation) are unit-checked without processes.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import yaml

pytest.importorskip("deepspeed")

from tests.distributed import run_ranks  # noqa: E402
from tests.recipes.torchrun_helpers import read_metrics, save_tiny_llama  # noqa: E402

STEPS = 3
TERMS = {"gce": {"weight": 0.5}, "smmd": {}, "ntl_was": {}, "ntl_mse": {}, "ntil": {"noise_scale": 0.0},
         "dist2": {"normalize": "numeric", "weighting": "place_value"}, "del": {}}


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    from data_prep.sources.base import SourceConfig
    from recipes.experiments.tiny import build_plain_shards, train_tokenizer

    root = tmp_path_factory.mktemp("ulysses")
    train_tokenizer(["Calculate 0123456789 + - * / = . ( ) What is"], root / "tok", "digits")
    build_plain_shards(SourceConfig(kind="arithmetic", options={"n": 64, "max_digits": 4, "negatives": False}),
                       root / "tok", root / "data")
    save_tiny_llama(root / "tok", root / "model")
    recipe = {"name": "ulysses", "model": {"name_or_path": str(root / "model"), "dtype": "float32",
                                           "attn_implementation": "sdpa"},
              # rows of 24 tokens on average padded to 48: the split at 24 cuts through the answers' numbers
              "data": {"train": str(root / "data"), "pad_to_multiple_of": 48}, "loss": {"objective": {"terms": TERMS}},
              "optim": {"lr": 3e-3, "schedule": "constant", "grad_clip": 100.0},
              "train": {"steps": STEPS, "save_every": 0, "progress": False, "seed": 7, "tensorboard": False,
                        "export": False}}
    path = root / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return root, path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train_rank(rank, world, argv, port, rejoin, exchanges):
    """One rank of `recipes.train.main(argv)`: the run makes (and at its end destroys) its own group from
    the environment, as under torchrun; then this rank joins a new group for run_ranks' closing barrier.
    NTIL's exchanges of straddling runs are counted into the file `exchanges`."""
    import numloss.losses.ntil as ntil
    import recipes.train

    dist.destroy_process_group()
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    calls = []
    original = ntil.sum_over_split

    def counted(parts, group):
        calls.append(parts.numel())
        return original(parts, group)

    ntil.sum_over_split = counted
    try:
        recipes.train.main(argv)
    except SystemExit as stop:
        assert not stop.code, f"recipes.train exited {stop.code}"
    finally:
        ntil.sum_over_split = original
    Path(f"{exchanges}.{rank}").write_text(json.dumps(calls))
    dist.init_process_group("gloo", init_method=f"file://{rejoin}", rank=rank, world_size=world)


def _train(workspace, name: str, world: int, *overrides: str) -> tuple[list[dict], list[list[int]]]:
    root, recipe = workspace
    out = root / name
    argv = [str(recipe), f"train.out_dir={out}", *overrides]
    run_ranks(world, _train_rank, argv, _free_port(), str(root / f"{name}.rejoin"), str(root / f"{name}.exchanges"),
              timeout=600)
    return read_metrics(out), [json.loads(Path(f"{root / name}.exchanges.{r}").read_text()) for r in range(world)]


@pytest.fixture(scope="module")
def reference(workspace):
    metrics, _ = _train(workspace, "sp1", 1, "train.micro_batch_size=4", "train.grad_accum=1", "deepspeed.zero_stage=2")
    return metrics


@pytest.mark.parametrize("name, world, overrides", [
    ("sp2-zero3-accum", 2, ("train.micro_batch_size=2", "train.grad_accum=2", "deepspeed.zero_stage=3")),
    ("sp2-zero2-chunked", 2, ("train.micro_batch_size=4", "train.grad_accum=1", "deepspeed.zero_stage=2",
                              "loss.head=chunked")),
    # 4 ranks: two sequence-parallel groups {0, 1}, {2, 3}, each a data-parallel replica reading its own rows
    ("sp2-dp2-zero3", 4, ("train.micro_batch_size=1", "train.grad_accum=2", "deepspeed.zero_stage=3")),
])
def test_sp2_equals_sp1(workspace, reference, name, world, overrides):
    split, exchanges = _train(workspace, name, world, "deepspeed.sp_size=2", *overrides)
    # numbers straddled the split: NTIL summed partial numbers over each group's two ranks, on both alike
    assert all(exchanges[r] == exchanges[r + 1] for r in range(0, world, 2)), exchanges
    assert sum(map(sum, exchanges)) > 0, exchanges
    assert [r["step"] for r in split] == [r["step"] for r in reference] == list(range(1, STEPS + 1))
    keys = ["loss", "ce", "grad_norm", *(f"term/{t}" for t in TERMS)]
    # the per-term gradient diagnostics (on by default): each rank's sums over its positions, summed over ranks
    diagnostics = [k for k in reference[0] if k.startswith("grad/") and k.endswith(("/norm", "/share"))]
    assert len(diagnostics) >= 2 * (len(TERMS) + 1)
    for got, want in zip(split, reference):
        for key in keys:
            assert got[key] == pytest.approx(want[key], rel=1e-4), f"step {got['step']} {key}: {got[key]} != {want[key]}"
        for key in diagnostics:
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-7), f"step {got['step']} {key}"
    assert split[-1]["loss"] != pytest.approx(split[0]["loss"], rel=1e-3)  # it trained


def test_a_checkpoint_saved_at_sp2_resumes_at_sp1(workspace, reference):
    """Steps 1-2 at sp 2 on 2 ranks (ZeRO-3, a checkpoint at step 2), then step 3 on 1 rank at sp 1: ZeRO's
    state saved over 2 ranks goes through the universal conversion, and step 3 logs the uninterrupted sp 1
    run's loss and gradient norm."""
    common = ("train.micro_batch_size=2", "train.grad_accum=2", "deepspeed.zero_stage=3", "train.save_every=2")
    _train(workspace, "resume", 2, "deepspeed.sp_size=2", "train.steps=2", *common)
    resumed, _ = _train(workspace, "resume", 1, "deepspeed.sp_size=1", "train.steps=3", *common)
    assert [r["step"] for r in resumed] == [1, 2, 3]  # metrics.jsonl holds the first start's two steps too
    for key in ("loss", "ce", "grad_norm"):
        assert resumed[2][key] == pytest.approx(reference[2][key], rel=1e-4), key
    assert (workspace[0] / "resume" / "checkpoints" / "step_00000002_universal").is_dir()  # converted, then loaded


# ---- refusals, without processes -----------------------------------------------------------------


def _recipe(**deepspeed):
    from recipes.config import recipe_from_dict

    return recipe_from_dict({"model": {"name_or_path": "x", "attn_implementation": deepspeed.pop("attn", None)},
                             "data": {"train": "d"}, "deepspeed": deepspeed})


def test_refusals_name_the_key():
    """Refused when the recipe loads (exit 2 in recipes.train), or against the model's config (the layout
    checks, before any model is built)."""
    from transformers import LlamaConfig

    from recipes.engines.deepspeed.pure.contract import ulysses_problems

    assert ulysses_problems(_recipe(sp_size=1, tp_size=2)) == []
    with pytest.raises(ValueError, match="deepspeed.sp_size: 2 with deepspeed.tp_size 2"):
        _recipe(sp_size=2, tp_size=2)
    with pytest.raises(ValueError, match="deepspeed.sp_size: 2 needs model.attn_implementation .* not 'eager'"):
        _recipe(sp_size=2, attn="eager")
    with pytest.raises(ValueError, match="deepspeed.sp_size: must be an integer >= 1"):
        _recipe(sp_size=0)
    cfg = LlamaConfig(hidden_size=48, num_attention_heads=6, num_key_value_heads=3)
    problems = ulysses_problems(_recipe(sp_size=4), cfg)
    assert any("does not divide the model's 6 attention heads" in p for p in problems)
    assert any("3 KV heads" in p for p in problems)


def test_packed_rows_are_refused():
    from recipes.engines.deepspeed.runtime.ulysses import SequenceGroup, split_batch

    batch = {"input_ids": torch.zeros(1, 8, dtype=torch.long), "labels": torch.zeros(1, 8, dtype=torch.long),
             "position_ids": torch.zeros(1, 8, dtype=torch.long), "sequence_ids": torch.ones(1, 8, dtype=torch.long)}
    with pytest.raises(ValueError, match="deepspeed.sp_size: 2 with packed rows"):
        split_batch(batch, SequenceGroup(0, 2, None))


def test_split_batch_shifts_before_the_split_and_pads():
    """The label of rank 0's last position is the first token of rank 1's slice; a row of 7 is padded to 8."""
    from recipes.engines.deepspeed.runtime.ulysses import SequenceGroup, split_batch

    ids = torch.arange(10, 17)[None]
    got = split_batch({"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)},
                      SequenceGroup(0, 2, None))
    whole = got["sequence_split"].labels
    assert whole.tolist() == [[11, 12, 13, 14, 15, 16, -100, -100]]
    assert got["input_ids"].tolist() == [[10, 11, 12, 13]]
    assert got["sequence_split"].local(whole).tolist() == [[11, 12, 13, 14]]  # 14: the next slice's first token
    assert got["position_ids"].tolist() == [[0, 1, 2, 3]]


def test_packed_data_is_refused_before_the_model():
    """preflight (recipes.train and recipes.validate, exit 2): packed shards with a sequence split name the key."""
    from recipes.checks.preflight import data_problems

    manifest = {"packed": True, "totals": {"rows": 64}}
    errors, _, _ = data_problems(_recipe(sp_size=2), manifest, "data/packed", 1)
    assert any(e.startswith("deepspeed.sp_size: 2 splits each row's positions") and "--pack-length" in e
               for e in errors), errors
    errors, _, _ = data_problems(_recipe(sp_size=1), manifest, "data/packed", 1)
    assert not any("splits each row" in e for e in errors)
