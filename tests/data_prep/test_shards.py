"""One reader of a data_prep manifest (`data_prep.shards.read_manifest`), and every place that opens a
data directory goes through it: a manifest of another schema version is refused there, naming the file
and both versions, before any shard is read; a missing one names the directory."""

from __future__ import annotations

import json

import pytest

from data_prep.shards import MANIFEST, SCHEMA_VERSION, read_manifest


def _data_dir(tmp_path, version):
    data = tmp_path / "data"
    data.mkdir()
    # the rest of the manifest would pass: only the version is wrong
    (data / MANIFEST).write_text(json.dumps({"schema_version": version, "packed": False, "shards": []}))
    return data


def test_reads_its_own_version_and_refuses_another(tmp_path):
    data = _data_dir(tmp_path, SCHEMA_VERSION)
    assert read_manifest(str(data))["schema_version"] == SCHEMA_VERSION
    (data / MANIFEST).write_text(json.dumps({"schema_version": SCHEMA_VERSION + 1, "shards": []}))
    with pytest.raises(ValueError, match=f"{MANIFEST}: schema version {SCHEMA_VERSION + 1}, this code reads "
                                         f"{SCHEMA_VERSION}"):
        read_manifest(str(data))
    with pytest.raises(FileNotFoundError, match=f"no {MANIFEST}"):
        read_manifest(str(tmp_path / "absent"))


def _shard_reader(data):
    from data_prep.reader import ShardDataset

    ShardDataset(str(data), batch_size=1)


def _statistics(data):
    from data_prep.stats import write_stats

    write_stats(str(data))


def _evaluation_rows(data):
    from recipes.evaluation.evaluate import load_rows

    load_rows(str(data))


def _preflight(data):
    # the static checks report it as an error line of `data.train` (validate's report, train's exit 2)
    from recipes.checks.preflight import static_checks
    from recipes.config import recipe_from_dict

    recipe = recipe_from_dict({"model": {"config": {"model_type": "llama"}, "tokenizer": "unused"}, "data": {"train": str(data)},
                               "train": {"out_dir": str(data.parent / "run")}})
    found = static_checks(recipe, 1, 1, check_model=False)
    raise ValueError("; ".join(found.errors))


@pytest.mark.parametrize("open_data", [_shard_reader, _statistics, _evaluation_rows, _preflight],
                         ids=["reader", "stats", "evaluation", "preflight"])
def test_every_reader_refuses_another_schema_version(tmp_path, open_data):
    data = _data_dir(tmp_path, SCHEMA_VERSION + 1)
    with pytest.raises(ValueError, match=f"schema version {SCHEMA_VERSION + 1}, this code reads {SCHEMA_VERSION}"):
        open_data(data)
