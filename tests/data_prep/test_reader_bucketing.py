"""Length bucketing in the training reader (`ShardDataset(length_bucketing=True)`): a global batch is the
same set of rows as without it, sorted longest first before it is dealt to ranks and micro-batches; the
order is the same on every layout, resumes from a sample count, and pads fewer tokens on a skewed mix.
The lengths the tests compare with are read from the shards with pyarrow, not through the reader."""

import json

import pyarrow.parquet as pq
import pytest

from data_prep import BuildConfig, ShardConfig, SourceConfig, TokenizeConfig, build
from data_prep.reader import ShardDataset

N, G = 120, 24  # 5 global batches per epoch


@pytest.fixture(scope="module")
def skewed(tmp_path_factory, digits_tok):
    """Three rows in four short (10-14 tokens), one in four long (179-183): a random micro-batch of 4 rows
    holds a long one more often than not, so it pads its short ones to the long length."""
    root = tmp_path_factory.mktemp("bucketing")
    with open(root / "rows.jsonl", "w") as fh:
        for i in range(N):
            filler = " ".join(["then add one more"] * (12 if i % 4 == 0 else 0))
            fh.write(json.dumps({"prompt": f"{filler} {i} + {i % 7} =".strip(), "target": str(i + i % 7)}) + "\n")
    out = str(root / "ds")
    build(BuildConfig(sources=[SourceConfig("generic", path=str(root / "rows.jsonl"))],
                      tokenize=TokenizeConfig(digits_tok, max_length=256),
                      shards=ShardConfig(shard_bytes=8000, row_group_rows=8)),
          out, workers=0, progress=False)
    return out


def lengths_by_record(path) -> dict[int, int]:
    """record -> tokens, straight from the Parquet files."""
    out = {}
    for shard in json.load(open(f"{path}/manifest.json"))["shards"]:
        table = pq.read_table(f"{path}/{shard['file']}", columns=["record", "input_ids"])
        for rec, ids in zip(table.column("record").to_pylist(), table.column("input_ids").to_pylist()):
            out[rec] = len(ids)
    return out


def steps(path, world, batch, bucketing, epochs=1):
    """[[(records, padded length) of each micro-batch of step s, in (micro-batch, rank) order]]."""
    readers = [ShardDataset(path, batch_size=batch, rank=r, world_size=world, seed=3, shuffle_window=50,
                            global_batch_size=G, length_bucketing=bucketing) for r in range(world)]
    gas = G // (world * batch)
    streams = [[(b["record"].tolist(), b["input_ids"].shape[1]) for _ in range(epochs) for b in ds] for ds in readers]
    return [[streams[r][s * gas + a] for a in range(gas) for r in range(world)] for s in range(len(streams[0]) // gas)]


def test_a_step_is_the_same_rows_sorted_longest_first_on_every_layout(skewed):
    length = lengths_by_record(skewed)
    plain = steps(skewed, 1, G, False, epochs=2)
    bucketed = steps(skewed, 2, 3, True, epochs=2)
    assert len(plain) == len(bucketed) == 2 * (N // G)
    for p, b in zip(plain, bucketed):
        records = [r for recs, _ in b for r in recs]
        assert sorted(records) == sorted(r for recs, _ in p for r in recs)  # the same rows train in the step
        assert [length[r] for r in records] == sorted((length[r] for r in records), reverse=True)
        assert all(t == max(length[r] for r in recs) for recs, t in b)  # each micro-batch padded to its own longest
    for world, batch in ((1, 4), (3, 2), (2, 6), (1, 24)):  # the sorted order does not depend on the layout
        flat = [[r for recs, _ in s for r in recs] for s in steps(skewed, world, batch, True, epochs=2)]
        assert flat == [[r for recs, _ in s for r in recs] for s in bucketed], (world, batch)


def test_bucketing_pads_fewer_tokens_on_a_skewed_mix(skewed):
    length = lengths_by_record(skewed)
    real = sum(length[r] for s in steps(skewed, 2, 4, False) for recs, _ in s for r in recs)

    def padded(bucketing):
        return sum(len(recs) * t for s in steps(skewed, 2, 4, bucketing) for recs, t in s)

    # by hand: each step's lengths sorted longest first, in blocks of 4 rows, each block padded to its first
    by_hand = 0
    for s in steps(skewed, 1, G, False):
        ordered = sorted((length[r] for recs, _ in s for r in recs), reverse=True)
        by_hand += sum(4 * ordered[i] for i in range(0, G, 4))
    assert padded(True) == by_hand
    assert padded(False) / real > 1.5 * padded(True) / real  # measured here: 2.81x against 1.26x
    assert padded(True) / real < 1.4


def test_resume_keeps_the_sample_count_contract(skewed):
    reference = steps(skewed, 1, 8, True)  # 3 micro-batches of 8 rows per step
    flat = [recs for s in reference for recs, _ in s]
    # two ranks x micro-batch 4 stop after one step and one micro-batch; one rank x 8 resumes from a step
    # boundary, and the same two-rank layout from inside the step
    first = [ShardDataset(skewed, batch_size=4, rank=r, world_size=2, seed=3, shuffle_window=50,
                          global_batch_size=G, length_bucketing=True) for r in range(2)]
    streams = [iter(ds) for ds in first]
    for _ in range(3):
        for s in streams:
            next(s)
    at_step = first[0].state_dict()
    assert at_step["samples"] == G and at_step["length_bucketing"] is True
    resumed = ShardDataset(skewed, batch_size=8, seed=3, shuffle_window=50, global_batch_size=G, length_bucketing=True)
    resumed.load_state_dict(at_step)
    assert [b["record"].tolist() for b in resumed] == flat[3:]
    for s in streams:
        next(s)
    inside = [ds.state_dict() for ds in first]
    assert inside[0]["samples"] == G + 8
    again = [ShardDataset(skewed, batch_size=4, rank=r, world_size=2, seed=3, shuffle_window=50, global_batch_size=G,
                          length_bucketing=True) for r in range(2)]
    for ds in again:
        ds.load_state_dict(inside[0])
    rest = [next(iter(ds))["record"].tolist() for ds in again]
    assert rest[0] + rest[1] == flat[4]  # the step's next 8 sorted rows
    # a step boundary resumes with bucketing switched either way; inside a step it would skip or repeat rows
    plain = ShardDataset(skewed, batch_size=8, seed=3, shuffle_window=50, global_batch_size=G)
    plain.load_state_dict(at_step)
    with pytest.raises(ValueError, match="inside a global batch of 24, with length_bucketing False"):
        plain.load_state_dict(inside[0])
    with pytest.raises(ValueError, match="length_bucketing sorts each global batch: it needs global_batch_size"):
        ShardDataset(skewed, batch_size=4, length_bucketing=True)
