"""`data.length_bucketing` in recipes.train (2 ranks on CPU, gloo, fp32: `tests.distributed.train_in_ranks`,
the loop and engine of a torchrun job in pre-started ranks; the properties are numbers): sorting each
global batch by length before it is dealt out changes which rank and micro-batch computes a row, not what
the step trains on, so step 1 logs the same loss and gradient norm (1e-6 relative) with and without it,
on 2 data-parallel ranks x 2 accumulated micro-batches of a skewed length mix, and a lower
`padding_ratio`. Both runs' `padding_ratio` are checked against the step's rows counted from the Parquet
files (pyarrow) and the reader's plain order. The Megatron engine, bucketed, logs the bucketed DeepSpeed
run's loss and the positions it ran. The three runs are made once (module fixture) and read by the tests."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
import yaml

pytest.importorskip("deepspeed")

from tests.distributed import train_in_ranks  # noqa: E402
from tests.recipes.torchrun_helpers import read_metrics, save_tiny_llama  # noqa: E402

G, B, PAD = 8, 2, 8  # global batch, rows per micro-batch (2 ranks x 2 micro-batches), data.pad_to_multiple_of
SEED = 3  # its step 1 has long and short rows mixed in each micro-batch: 1.56x padded without bucketing, 1.23x with


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    from recipes.experiments.tiny import build_jsonl_shards, train_tokenizer

    root = tmp_path_factory.mktemp("bucketing")
    train_tokenizer(["Calculate 0123456789 + - * / = . ( ) then add one more"], root / "tok", "digits")
    with open(root / "rows.jsonl", "w") as fh:  # every other row ~3.5x longer
        for i in range(48):
            filler = " ".join(["then add one more"] * (3 if i % 2 == 0 else 0))
            fh.write(json.dumps({"prompt": f"{filler} Calculate {i} + {i % 7} =".strip(),
                                 "target": str(i + i % 7)}) + "\n")
    build_jsonl_shards(root / "rows.jsonl", root / "tok", root / "data", max_length=96)
    save_tiny_llama(root / "tok", root / "model")
    recipe = {"name": "bucketing", "model": {"name_or_path": str(root / "model"), "dtype": "float32"},
              "data": {"train": str(root / "data"), "shuffle_window": 64, "pad_to_multiple_of": PAD},
              "loss": {"objective": {"terms": {"smmd": {}, "ntl_was": {}}}},
              "optim": {"lr": 3e-3, "schedule": "constant", "grad_clip": 100.0},
              "train": {"steps": 1, "save_every": 0, "export": False, "progress": False, "seed": SEED,
                        "micro_batch_size": B, "grad_accum": 2, "tensorboard": False},
              "deepspeed": {"zero_stage": 2}}
    (root / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    return root


def expected_padding_ratio(root, bucketing: bool) -> float:
    """Step 1's padded positions / real tokens: its rows in the seeded order (the plain reader, one rank
    reading the whole global batch), lengths from the Parquet files, micro-batches of B rows in the
    reader's dealing order (sorted longest first with bucketing), each padded to its longest rounded up
    to PAD."""
    from data_prep.reader import ShardDataset

    step = next(iter(ShardDataset(str(root / "data"), batch_size=G, seed=SEED, shuffle_window=64,
                                  global_batch_size=G)))["record"].tolist()
    length = {}
    for shard in json.loads((root / "data" / "manifest.json").read_text())["shards"]:
        table = pq.read_table(root / "data" / shard["file"], columns=["record", "input_ids"])
        length.update({rec: len(ids) for rec, ids in zip(table.column("record").to_pylist(),
                                                          table.column("input_ids").to_pylist())})
    rows = [length[r] for r in step]
    if bucketing:
        rows = sorted(rows, reverse=True)
    padded = sum(B * -(-max(rows[i:i + B]) // PAD) * PAD for i in range(0, G, B))
    return padded / sum(rows)


RUNS = {"plain": ["data.length_bucketing=false"], "bucketed": ["data.length_bucketing=true"],
        "megatron": ["data.length_bucketing=true", "train.engine=megatron", "deepspeed.zero_stage=3"]}


@pytest.fixture(scope="module")
def rows(workspace):
    """Step 1's logged row of each run of RUNS, on 2 ranks."""
    found = {}
    for name, overrides in RUNS.items():
        out = workspace / name
        outcomes = train_in_ranks(2, [str(workspace / "recipe.yaml"), f"train.out_dir={out}", *overrides])
        assert [o["error"] for o in outcomes] == [None, None], outcomes
        found[name] = read_metrics(out)[0]
    return found


def test_bucketing_keeps_the_loss_and_gradient_and_cuts_padding(workspace, rows):
    plain, sorted_ = rows["plain"], rows["bucketed"]
    for key in ("loss", "ce", "term/smmd", "term/ntl_was", "grad_norm"):
        assert sorted_[key] == pytest.approx(plain[key], rel=1e-6), key
    for bucketing, row in ((False, plain), (True, sorted_)):
        assert row["padding_ratio"] == pytest.approx(expected_padding_ratio(workspace, bucketing), rel=1e-12)
    assert sorted_["padding_ratio"] < plain["padding_ratio"] - 0.2, (sorted_["padding_ratio"], plain["padding_ratio"])


def test_megatron_logs_the_positions_it_ran(workspace, rows):
    """The Megatron engine cuts each micro-batch at its last real column, rounded up to data.pad_to_multiple_of
    (and TP under SP; the CPU path's block-mask form), and returns the positions it ran (tokens_run):
    padding_ratio is that count, and the loss the bucketed DeepSpeed run's."""
    row = rows["megatron"]
    assert row["padding_ratio"] == pytest.approx(expected_padding_ratio(workspace, True), rel=1e-12)
    assert row["loss"] == pytest.approx(rows["bucketed"]["loss"], rel=1e-4)
