"""The one Hugging Face export writer (recipes/reliability/export_writer.py), on 2 real gloo ranks.

A process killed (SIGKILL) anywhere in an export over an existing `final/` leaves `final/` the old model or
the new one, whole: it loads with from_pretrained (weights and tokenizer) and its record names the step
of the weights it holds. Kill points: a rank right after writing its shard (mid-export), rank 0 after the
tokenizer (mid-assembly, before the record), rank 0 right after the atomic exchange (before the old export
is removed), and, on a file system without the exchange, rank 0 between the two renames (then `final/` is
missing until the next start's `clean_leftovers` puts the old one back). After the kill `clean_leftovers`
leaves nothing beside `final/`. Also: every file of an export gets the default mode (safetensors writes
its shards 0600), under two umasks.
"""

from __future__ import annotations

import json
import os
import signal
import stat
from pathlib import Path

import pytest
import torch
from torch.multiprocessing import ProcessExitedException, ProcessRaisedException

from tests.distributed import run_ranks

pytestmark = pytest.mark.timeout(600)

KILL_POINTS = ("after a shard", "mid-assembly", "after the exchange", "between the two renames")


def _model(shift: float = 0.0):
    """A tiny Llama with fixed weights (+ `shift` on every tensor): the old export at 0, the new at 1."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=24, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                                         tie_word_embeddings=False))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(shift)
    return model


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _export(rank, world, root: str, kill_at: str | None):
    from transformers import AutoTokenizer

    from recipes.reliability import export_writer as writer

    root = Path(root)
    tokenizer = AutoTokenizer.from_pretrained(root / "tok")
    final = root / "final"

    def export(shift: float, step: int, kill: str | None = None):
        model = _model(shift)
        state = model.state_dict()
        mine = {k: v.contiguous() for i, (k, v) in enumerate(sorted(state.items())) if i % world == rank}

        def write_shards(staging: Path):
            shard = writer.write_shard(staging, f"rank-{rank:05d}.safetensors", mine)
            if kill == "after a shard" and rank == 1:
                _die()
            return [shard]

        record = writer.ExportRecord(step, f"step_{step:08d}", None, "0" * 64, "test")
        files = writer.HFFiles(model.config, None, tokenizer)
        return writer.write_export(final, write_shards, files, record)

    export(0.0, 4)  # the old export
    torch.distributed.barrier()
    if rank == 0 and kill_at == "mid-assembly":
        save = type(tokenizer).save_pretrained

        def save_then_die(self, *args, **kwargs):
            save(self, *args, **kwargs)
            _die()

        type(tokenizer).save_pretrained = save_then_die
    if rank == 0 and kill_at == "after the exchange":
        real = writer.exchange
        writer.exchange = lambda a, b: real(a, b) and _die()
    if rank == 0 and kill_at == "between the two renames":
        writer.exchange = lambda a, b: False  # as on a file system without renameat2's exchange
        replace = os.replace

        def replace_then_die(src, dst):
            replace(src, dst)
            if str(dst).endswith(".final.old"):
                _die()

        writer.os.replace = replace_then_die
    export(1.0, 6, kill_at)


def _loads_as(final: Path, tokenizer_dir: Path) -> int:
    """The step `final/` holds, after checking it loads whole: its weights are the model of that step
    (the old export's at step 4, the new one's at 6), its tokenizer the one exported."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from recipes.reliability.export_writer import read_record

    record = read_record(final)
    assert record is not None and record.step in (4, 6), record
    loaded = AutoModelForCausalLM.from_pretrained(final).state_dict()
    want = _model(0.0 if record.step == 4 else 1.0).state_dict()
    assert set(loaded) == set(want)
    for key, value in want.items():
        assert torch.equal(loaded[key], value), key
    assert AutoTokenizer.from_pretrained(final).get_vocab() == AutoTokenizer.from_pretrained(tokenizer_dir).get_vocab()
    return record.step


@pytest.mark.parametrize("kill_at", KILL_POINTS)
def test_an_export_killed_anywhere_leaves_the_old_or_the_new_model(tmp_path, kill_at):
    from recipes.experiments.tiny import train_tokenizer
    from recipes.reliability.export_writer import clean_leftovers

    train_tokenizer(["0123456789 + - = ."], tmp_path / "tok", "digits")
    with pytest.raises((ProcessExitedException, ProcessRaisedException)):  # the killed rank, or its peer
        run_ranks(2, _export, str(tmp_path), kill_at, timeout=300)
    final = tmp_path / "final"
    leftovers = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".final"))
    if kill_at == "between the two renames":
        assert not final.exists() and leftovers == [".final.old", ".final.partial"], leftovers
    else:
        step = _loads_as(final, tmp_path / "tok")
        assert step == (6 if kill_at == "after the exchange" else 4), step  # the exchange is the commit
    said = clean_leftovers(final)
    assert said, "an interrupted export leaves something to clean"
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".final")]
    step = _loads_as(final, tmp_path / "tok")
    assert step == (6 if kill_at == "after the exchange" else 4)


def test_an_uninterrupted_export_records_what_it_holds(tmp_path):
    from recipes.experiments.tiny import train_tokenizer
    from recipes.reliability.export_writer import INDEX

    train_tokenizer(["0123456789 + - = ."], tmp_path / "tok", "digits")
    run_ranks(2, _export, str(tmp_path), None, timeout=300)
    final = tmp_path / "final"
    assert _loads_as(final, tmp_path / "tok") == 6
    index = json.loads((final / INDEX).read_text())
    assert sorted(set(index["weight_map"].values())) == ["model-00001-of-00002.safetensors",
                                                        "model-00002-of-00002.safetensors"]
    total = sum(v.numel() * v.element_size() for v in _model().state_dict().values())
    assert index["metadata"]["total_size"] == total
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".final")]


# ---- file modes ---------------------------------------------------------------------------------

@pytest.fixture(params=[0o022, 0o027])
def umask(request):
    previous = os.umask(request.param)
    yield request.param
    os.umask(previous)


def test_every_file_of_an_export_gets_the_default_mode(tmp_path, umask):
    """safetensors (0.7 on) writes through a private temporary file: its shards were 0600 beside a 0644
    config and tokenizer, so a serving job under another uid could read the config but not the weights."""
    from safetensors.torch import save_file

    from recipes.experiments.tiny import train_tokenizer
    from recipes.reliability.export_writer import ExportRecord, HFFiles, Shard, _assemble, staging_dir
    from recipes.training.file_modes import default_file_mode

    tokenizer = train_tokenizer(["0123456789 + ="], tmp_path / "tok", "digits")
    path = tmp_path / "final"
    staging = staging_dir(path)
    staging.mkdir()
    for name in ("a.safetensors", "b.safetensors"):
        save_file({name[0]: torch.zeros(2)}, str(staging / name))
    assert stat.S_IMODE((staging / "a.safetensors").stat().st_mode) == 0o600  # what safetensors does
    parts = [[Shard("a.safetensors", ["a"], 8)], [Shard("b.safetensors", ["b"], 8)]]
    _assemble(parts, staging, path, HFFiles(_model().config, None, tokenizer), ExportRecord(1, None, None, "", "t"))
    modes = {str(p.relative_to(path)): stat.S_IMODE(p.stat().st_mode) for p in path.rglob("*") if p.is_file()}
    assert {"model-00001-of-00002.safetensors", "config.json", "tokenizer.json", "numloss_export.json"} <= set(modes)
    assert set(modes.values()) == {default_file_mode()} == {0o666 & ~umask}, modes
