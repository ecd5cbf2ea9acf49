"""The training reader: rank splits, per-epoch shuffles, and exact resume."""

import multiprocessing as mp

import pyarrow.parquet as pq
import pytest
import torch

from data_prep import BuildConfig, ShardConfig, SourceConfig, TokenizeConfig, build
from data_prep.reader import ShardDataset

N = 203  # not a multiple of any world size x batch size used below


@pytest.fixture(scope="module")
def dataset(tmp_path_factory, digits_tok):
    out = str(tmp_path_factory.mktemp("reader") / "ds")
    build(BuildConfig(sources=[SourceConfig("arithmetic", options={"n": N, "max_digits": 4})],
                      tokenize=TokenizeConfig(digits_tok),
                      shards=ShardConfig(shard_bytes=6000, row_group_rows=8)),
          out, workers=0, progress=False)
    return out


@pytest.fixture(scope="module")
def packed_dataset(tmp_path_factory, digits_tok):
    out = str(tmp_path_factory.mktemp("reader") / "packed")
    build(BuildConfig(sources=[SourceConfig("arithmetic", options={"n": N, "max_digits": 4})],
                      tokenize=TokenizeConfig(digits_tok, max_length=96),
                      shards=ShardConfig(shard_bytes=6000, row_group_rows=4, pack_length=96)),
          out, workers=0, progress=False)
    return out


def records(ds):
    return [r for b in ds for r in b["record"].tolist()]


def _rank_records(args):
    path, rank, world = args
    return records(ShardDataset(path, batch_size=5, rank=rank, world_size=world, drop_last=False,
                                shuffle_window=16, seed=7))


def test_rank_splits_cover_every_example_once(dataset):
    manifest_rows = ShardDataset(dataset, batch_size=1).num_rows
    assert manifest_rows == N
    for world in (1, 2, 3, 4):
        per_rank = [_rank_records((dataset, r, world)) for r in range(world)]
        flat = [x for rr in per_rank for x in rr]
        assert sorted(flat) == list(range(N)), world
        assert max(map(len, per_rank)) - min(map(len, per_rank)) <= 1


def test_rank_splits_in_real_processes(dataset):
    with mp.get_context("fork").Pool(3) as pool:
        per_rank = pool.map(_rank_records, [(dataset, r, 3) for r in range(3)])
    assert sorted(x for rr in per_rank for x in rr) == list(range(N))
    assert per_rank == [_rank_records((dataset, r, 3)) for r in range(3)]  # same order in any process


def test_drop_last_gives_equal_full_batches_without_overlap(dataset):
    world, b = 4, 6
    sets = []
    for r in range(world):
        ds = ShardDataset(dataset, batch_size=b, rank=r, world_size=world, seed=1, shuffle_window=16)
        batches = list(ds)
        assert len(batches) == len(ds) == N // (world * b)
        assert all(x["input_ids"].shape[0] == b for x in batches)
        sets.append({x for bb in batches for x in bb["record"].tolist()})
    union = set().union(*sets)
    assert sum(map(len, sets)) == len(union) == (N // (world * b)) * world * b
    assert N - len(union) < world * b


def test_shuffle_is_deterministic_per_epoch(dataset):
    def order(seed, epoch, **kw):
        ds = ShardDataset(dataset, batch_size=7, seed=seed, drop_last=False, shuffle_window=32, **kw)
        ds.set_epoch(epoch)
        return records(ds)

    e0, e1 = order(3, 0), order(3, 1)
    assert e0 == order(3, 0) and sorted(e0) == sorted(e1) == list(range(N))
    assert e0 != e1 and e0 != order(4, 0)
    assert e0 != list(range(N))
    assert order(3, 0, shuffle=False) == list(range(N))
    # the epoch counter advances by itself after a full pass
    ds = ShardDataset(dataset, batch_size=7, seed=3, drop_last=False, shuffle_window=32)
    assert records(ds) == e0 and records(ds) == e1


def test_resume_sees_exactly_the_same_batches(dataset):
    kw = dict(batch_size=4, rank=1, world_size=2, seed=11, shuffle_window=24)
    full = ShardDataset(dataset, **kw)
    want = [b["record"].tolist() for _ in range(3) for b in full]  # three epochs
    per_epoch = len(full)
    for stop in (0, 5, per_epoch - 1, per_epoch, per_epoch + 3):
        first = ShardDataset(dataset, **kw)
        got = []
        state = first.state_dict() if stop == 0 else None
        while state is None:
            for b in first:
                got.append(b["record"].tolist())
                if len(got) == stop:
                    state = first.state_dict()
                    break
        resumed = ShardDataset(dataset, **kw)
        resumed.load_state_dict(state)
        while len(got) < len(want):
            got += [b["record"].tolist() for b in resumed]
        assert got == want, stop
    other = ShardDataset(dataset, **{**kw, "world_size": 4})
    with pytest.raises(ValueError, match="world_size"):
        other.load_state_dict(full.state_dict())


def test_batch_contents_match_the_shards(dataset):
    rows = {}
    for f in sorted(p for p in __import__("os").listdir(dataset) if p.endswith(".parquet")):
        for r in pq.read_table(f"{dataset}/{f}").to_pylist():
            rows[r["record"]] = r
    ds = ShardDataset(dataset, batch_size=8, seed=0, pad_to_multiple_of=8)
    pad = ds.pad_id
    for batch in ds:
        t = batch["input_ids"].shape[1]
        assert t % 8 == 0
        for j, rec in enumerate(batch["record"].tolist()):
            r = rows[rec]
            n = len(r["input_ids"])
            assert batch["input_ids"][j, :n].tolist() == r["input_ids"]
            assert batch["labels"][j, :n].tolist() == r["labels"]
            assert batch["numeric_mask"][j, :n].tolist() == r["numeric_mask"]
            assert batch["attention_mask"][j].tolist() == [True] * n + [False] * (t - n)
            assert (batch["input_ids"][j, n:] == pad).all() and (batch["labels"][j, n:] == -100).all()
            assert batch["answer"][j].item() == r["answer"]
            sel = batch["span_batch"] == j
            assert batch["span_start"][sel].tolist() == r["span_start"]
            assert batch["span_value"][sel].tolist() == r["span_value"]
    fixed = next(iter(ShardDataset(dataset, batch_size=2, seq_len=64)))
    assert fixed["input_ids"].shape == (2, 64)


def test_packed_batches(packed_dataset):
    ds = ShardDataset(packed_dataset, batch_size=3, drop_last=False, seed=2)
    seen = []
    for batch in ds:
        assert set(batch) >= {"input_ids", "labels", "position_ids", "segment_ids", "attention_mask", "records"}
        assert torch.equal(batch["attention_mask"], batch["segment_ids"] > 0)
        for j in range(batch["input_ids"].shape[0]):
            seg = batch["segment_ids"][j]
            pos = batch["position_ids"][j]
            starts = (pos == 0) & (seg > 0)
            assert (batch["labels"][j][starts] == -100).all()  # no cross-example target
            assert int(seg.max()) == int(starts.sum()) == int((batch["segment_batch"] == j).sum())
        seen += batch["records"].tolist()
    assert sorted(seen) == list(range(N))


# ---- the training order: one sample order for every layout ---------------------------------------------

G = 24  # the global batch; 203 rows -> 8 steps per epoch, 11 rows left out


def _steps(dataset, world, batch, epochs=2, seed=5):
    """[[records of step s, in (micro-batch, rank, row) order]] over `epochs` epochs at this layout."""
    readers = [ShardDataset(dataset, batch_size=batch, rank=r, world_size=world, seed=seed, shuffle_window=40,
                            global_batch_size=G) for r in range(world)]
    gas = G // (world * batch)
    streams = [[b["record"].tolist() for _ in range(epochs) for b in ds] for ds in readers]
    steps = len(streams[0]) // gas
    return [[rec for a in range(gas) for r in range(world) for rec in streams[r][s * gas + a]] for s in range(steps)]


def test_every_layout_reads_the_same_global_batches(dataset):
    reference = _steps(dataset, world=1, batch=G)
    assert len(reference) == 2 * (N // G)
    assert all(len(set(step)) == G for step in reference)
    epoch = [r for step in reference[:N // G] for r in step]
    assert len(set(epoch)) == len(epoch) == (N // G) * G  # no row twice in an epoch
    assert reference[:N // G] != reference[N // G:]  # the second epoch is another order
    for world, batch in ((2, 12), (2, 3), (3, 4), (1, 6)):
        assert _steps(dataset, world, batch) == reference, (world, batch)


def test_resume_onto_another_layout_continues_the_same_order(dataset):
    """Two ranks x micro-batch 4 (3 accumulated) stop after 3 steps; one rank x micro-batch 8 resumes
    from rank 0's state and reads the global batches the uninterrupted run reads."""
    reference = _steps(dataset, world=1, batch=G, epochs=1)
    first = [ShardDataset(dataset, batch_size=4, rank=r, world_size=2, seed=5, shuffle_window=40,
                          global_batch_size=G) for r in range(2)]
    streams = [iter(ds) for ds in first]
    for _ in range(3 * 3):
        for s in streams:
            next(s)
    states = [ds.state_dict() for ds in first]
    assert states[0] == states[1] and states[0]["samples"] == 3 * G
    resumed = ShardDataset(dataset, batch_size=8, seed=5, shuffle_window=40, global_batch_size=G)
    resumed.load_state_dict(states[0])
    rest = [b["record"].tolist() for b in resumed]
    assert [sum(rest[i:i + 3], []) for i in range(0, len(rest), 3)] == reference[3:]
    other_g = ShardDataset(dataset, batch_size=8, seed=5, shuffle_window=40, global_batch_size=16)
    with pytest.raises(ValueError, match="global_batch_size"):
        other_g.load_state_dict(states[0])
    mid = ShardDataset(dataset, batch_size=16, seed=5, shuffle_window=40, global_batch_size=48)
    with pytest.raises(ValueError, match="step boundary"):
        mid.load_state_dict({**states[0], "global_batch_size": 48, "samples": 24})
    with pytest.raises(ValueError, match="multiple of batch_size"):
        ShardDataset(dataset, batch_size=5, world_size=2, global_batch_size=G)
