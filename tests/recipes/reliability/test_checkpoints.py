"""Checkpoints are verified (recipes.reliability.checkpoints), on 2 real gloo ranks with a stand-in
engine that writes one state file per rank, as DeepSpeed writes its shards.

- a truncated file in the newest checkpoint (unverified, DeepSpeed would fail with `PytorchStreamReader
  failed reading zip archive`, naming no file, with no fallback): the run names the file, warns, resumes
  from the previous intact checkpoint (and keeps the corrupt one aside); with `resume_fallback: false` it
  refuses and prints the command that falls back;
- a planted `rank_00000.pt` that would run code when unpickled (a shared run directory; its entry in
  checkpoint.json rewritten to match): refused by `torch.load(weights_only=True)`, nothing runs;
- every save wrote checkpoint.json (size and sha256 of every file) before `latest` named it;
- a save whose commit is cut short after its checkpoint.json (rank 0 SIGKILLed where it renames the staging
  directory) is verified and committed at the next start; a missing or unreadable `latest` resumes from the
  newest intact checkpoint, a damaged newer one named; so does a `latest` whose step directory is gone.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.distributed import run_ranks

pytestmark = pytest.mark.timeout(300)


class FakeData:
    def __init__(self):
        self.position = 0

    def state_dict(self):
        return {"epoch": 0, "samples": self.position, "fingerprint": "abc"}

    def load_state_dict(self, state):
        self.position = state["samples"]


class Planted:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):  # what a hostile file in a shared directory would do at unpickling
        return (os.system, (f"touch {self.marker}",))


def _engine_state(rank):
    def save(directory: Path):
        torch.save({"weights": torch.full((64,), float(rank))}, directory / f"model_rank{rank}.pt")

    def load(directory: Path):
        torch.load(directory / f"model_rank{rank}.pt", weights_only=True)
    return save, load


def _rank(rank, world, root: str):
    from recipes.reliability.checkpoints import CheckpointCorrupt, CheckpointDirs, MANIFEST
    from recipes.training.runtime import Runtime

    root = Path(root)
    runtime = Runtime(rank, world, rank, torch.device("cpu"))
    save, load = _engine_state(rank)
    data = FakeData()
    dirs = CheckpointDirs(root, keep_last=3, runtime=runtime)
    for step in (2, 4):
        data.position = step * 8
        dirs.save(step, data, save, {"data_parallel": world})
    recorded = json.loads((root / "step_00000004" / MANIFEST).read_text())["files"]
    assert {"model_rank0.pt", "model_rank1.pt", "rank_00000.pt", "rank_00001.pt", "layout.json"} <= set(recorded)
    dist.barrier()

    # a truncated shard in the newest checkpoint, with the fallback refused
    if rank == 1:
        path = root / "step_00000004" / "model_rank0.pt"
        path.write_bytes(path.read_bytes()[:100])
    dist.barrier()
    with pytest.raises(CheckpointCorrupt) as err:
        CheckpointDirs(root, 3, runtime, fallback=False).load(FakeData(), load)
    message = str(err.value)
    assert f"{root / 'step_00000004' / 'model_rank0.pt'}: 100 bytes" in message, message
    assert f"echo step_00000002 > {root / 'latest'}" in message
    # the default: a warning naming the file, and the previous checkpoint
    resumed = FakeData()
    assert CheckpointDirs(root, 3, runtime).load(resumed, load) == 2 and resumed.position == 16
    assert (root / "latest").read_text() == "step_00000002" and (root / "corrupt_step_00000004").is_dir()
    dist.barrier()

    # a planted pickle that runs code, checksummed to look intact
    marker = root / "code_ran"
    if rank == 0:
        state = root / "step_00000002" / "rank_00000.pt"
        state.write_bytes(pickle.dumps({"step": 2, "data": Planted(marker)}))
        manifest_path = root / "step_00000002" / MANIFEST
        manifest = json.loads(manifest_path.read_text())
        from data_prep.shards import sha256_file
        manifest["files"]["rank_00000.pt"] = {"bytes": state.stat().st_size, "sha256": sha256_file(state)}
        manifest_path.write_text(json.dumps(manifest))
    dist.barrier()
    dirs = CheckpointDirs(root, 3, runtime)
    if rank == 0:
        with pytest.raises(pickle.UnpicklingError):
            dirs.load(FakeData(), load)
    else:
        dirs.load(FakeData(), load)  # its own, intact file
    assert not marker.exists()


def test_corrupt_checkpoints_are_named_and_fall_back_and_planted_files_do_not_run(tmp_path, capfd):
    run_ranks(2, _rank, str(tmp_path))
    err = capfd.readouterr().err
    assert "warning: checkpoint" in err and "model_rank0.pt: 100 bytes, " in err and "Resuming from step_00000002" in err


def _engine_writing(rank, numel):
    """A stand-in engine's save: this rank's shard, then a collective, as DeepSpeed's closing barrier."""
    def save(directory: Path):
        torch.save({"weights": torch.zeros(numel)}, directory / f"model_rank{rank}.pt")
        dist.barrier()
    return save


def _failed_and_unfinished_saves(rank, world, root: str):
    import resource
    import signal

    from recipes.reliability.checkpoints import MANIFEST, CheckpointDirs, CheckpointSaveFailed
    from recipes.training.runtime import Runtime

    root = Path(root)
    runtime = Runtime(rank, world, rank, torch.device("cpu"))
    _, load = _engine_state(rank)
    data = FakeData()
    dirs = CheckpointDirs(root, keep_last=1, runtime=runtime)
    dirs.save(2, data, _engine_writing(rank, 64), {})

    # rank 1's shard of step 4 passes its file-size limit: the kernel refuses the write (EFBIG) and torch's
    # writer raises "unexpected pos ..." naming no file; a failure not shared would leave rank 0 waiting in
    # the engine's barrier
    if rank == 1:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, hard))
    try:
        with pytest.raises(CheckpointSaveFailed) as err:
            dirs.save(4, data, _engine_writing(rank, 100_000), {})
    finally:
        if rank == 1:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    message = str(err.value)
    assert f"checkpoint step 4 was not saved: rank 1 could not write {root / '.step_00000004.partial'}" in message
    assert "model_rank1.pt (a write came up short (torch's 'unexpected pos': a full disk, a quota or a file-size limit): " \
           "RuntimeError: " in message and " GiB free of " in message, message
    assert "rank 0 could not" not in message and "`latest` names step_00000002" in message, message
    dist.barrier()
    assert (root / "latest").read_text() == "step_00000002"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000002"]  # nothing of step 4 left
    dist.barrier()  # every rank has looked before rank 0 plants the leftovers below

    # what saves killed half-way leave: a staging directory, a step directory without checkpoint.json
    # (an older version's partial save: its name sorted after every good checkpoint, so pruning by name
    # kept it and deleted the one just saved), and a complete one `latest` never named
    if rank == 0:
        (root / ".step_00000006.partial").mkdir()
        (root / ".step_00000006.partial" / "model_rank0.pt").write_bytes(b"half")
        (root / "step_00000005").mkdir()
        (root / "step_00000005" / "model_rank0.pt").write_bytes(b"half")
        shutil.copytree(root / "step_00000002", root / "step_00000007")
    dist.barrier()
    dirs = CheckpointDirs(root, keep_last=1, runtime=runtime)
    assert dirs.load(data, load) == 2 and data.position == 0
    assert sorted(p.name for p in root.iterdir()) == ["latest", "skipped_step_00000007", "step_00000002"]
    dist.barrier()  # every rank has looked before rank 0 stages step 3
    dirs.save(3, data, _engine_writing(rank, 64), {})  # keep_last 1: step 3 alone
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step_")) == ["step_00000003"]
    assert (root / "latest").read_text() == "step_00000003"

    # a save of a step whose failed attempt left files: none of them enters the new checkpoint
    if rank == 0:
        (root / ".step_00000004.partial").mkdir()
        (root / ".step_00000004.partial" / "stale.pt").write_bytes(b"from the failed attempt")
    dist.barrier()
    dirs = CheckpointDirs(root, keep_last=2, runtime=runtime)
    dirs.save(4, data, _engine_writing(rank, 64), {})
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step_")) == ["step_00000003", "step_00000004"]
    recorded = json.loads((root / "step_00000004" / MANIFEST).read_text())["files"]
    assert sorted(recorded) == ["layout.json", "model_rank0.pt", "model_rank1.pt", "rank_00000.pt", "rank_00001.pt"]
    assert not (root / "step_00000004" / "stale.pt").exists()
    resumed = FakeData()
    assert CheckpointDirs(root, 2, runtime).load(resumed, load) == 4  # the next start: the newest, intact


def test_a_failed_save_fails_on_every_rank_and_leftovers_never_shadow_a_good_checkpoint(tmp_path, capfd):
    """A write that fails on rank 1 (a real kernel refusal) fails the save on both ranks with the file, the
    rank and the free space; `latest` stays on step 2. Leftovers of saves killed half-way are cleared at
    the next start (the complete one `latest` never named kept aside), and pruning with keep_last 1 and 2
    keeps the newest intact checkpoints: rank 0 does not hang in the barrier, and pruning by name would
    delete the checkpoint just saved while keeping the partial step 5."""
    run_ranks(2, _failed_and_unfinished_saves, str(tmp_path), timeout=120)
    err = capfd.readouterr().err
    assert f"removed {tmp_path / 'step_00000005'}: newer than step_00000002" in err, err[-3000:]
    assert f"removed {tmp_path / '.step_00000006.partial'}: the staging directory" in err
    assert f"{tmp_path / 'step_00000007'} is complete but newer than step_00000002" in err


def _save_then_die_before_the_rename(rank, world, root: str):
    """Steps 2 and 4 saved; step 6's save is cut short on rank 0 right after its checkpoint.json, where
    its staging directory would be renamed (a SIGKILL, as torchrun's shutdown timeout sends)."""
    import signal

    from recipes.reliability.checkpoints import CheckpointDirs
    from recipes.training.runtime import Runtime

    root = Path(root)
    runtime = Runtime(rank, world, rank, torch.device("cpu"))
    save, _ = _engine_state(rank)
    data = FakeData()
    dirs = CheckpointDirs(root, keep_last=3, runtime=runtime)
    for step in (2, 4):
        data.position = step * 8
        dirs.save(step, data, save, {"data_parallel": world})
    dist.barrier()
    if rank == 0:
        replace = os.replace

        def die_at_the_commit(src, dst):
            if str(src).endswith(".step_00000006.partial"):
                os.kill(os.getpid(), signal.SIGKILL)
            replace(src, dst)

        os.replace = die_at_the_commit
    data.position = 48
    dirs.save(6, data, save, {"data_parallel": world})


def _resume(rank, world, root: str, expected: int, marker: str | None):
    from recipes.reliability.checkpoints import CheckpointDirs
    from recipes.training.runtime import Runtime

    root = Path(root)
    runtime = Runtime(rank, world, rank, torch.device("cpu"))
    if rank == 0 and marker is not None:
        (root / "latest").write_text(marker) if marker else (root / "latest").unlink()
    dist.barrier()
    _, load = _engine_state(rank)
    resumed = FakeData()
    assert CheckpointDirs(root, 3, runtime).load(resumed, load) == expected and resumed.position == expected * 8
    assert (root / "latest").read_text() == f"step_{expected:08d}"


def test_a_verified_save_cut_short_is_committed_and_a_lost_latest_resumes_the_newest(tmp_path, capfd):
    """A missing `latest` does not set every checkpoint aside as `skipped_step_*` (the run would start at
    step 0), and a staging directory with its checkpoint.json is committed, not thrown away."""
    from torch.multiprocessing import ProcessExitedException, ProcessRaisedException

    with pytest.raises((ProcessExitedException, ProcessRaisedException)):  # rank 0 killed, rank 1 left alone
        run_ranks(2, _save_then_die_before_the_rename, str(tmp_path), timeout=120)
    staged = tmp_path / ".step_00000006.partial"
    assert (staged / "checkpoint.json").is_file() and (tmp_path / "latest").read_text() == "step_00000004"

    run_ranks(2, _resume, str(tmp_path), 6, None, timeout=120)  # the cut-short commit is completed
    err = capfd.readouterr().err
    assert f"{staged} holds a verified checkpoint whose commit was cut short" in err and "committed as step_00000006" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000002", "step_00000004", "step_00000006"]

    run_ranks(2, _resume, str(tmp_path), 6, "", timeout=120)  # `latest` deleted
    err = capfd.readouterr().err
    assert f"{tmp_path / 'latest'} is missing: resuming from step_00000006, the newest intact checkpoint" in err, err
    run_ranks(2, _resume, str(tmp_path), 6, "step_0000\x00garbage", timeout=120)  # `latest` unreadable
    err = capfd.readouterr().err
    assert "not a checkpoint's name: resuming from step_00000006" in err, err

    # the newest one damaged and `latest` gone: the newest intact one, the damaged one named
    shard = tmp_path / "step_00000006" / "model_rank1.pt"
    shard.write_bytes(shard.read_bytes()[:50])
    run_ranks(2, _resume, str(tmp_path), 4, "", timeout=120)
    err = capfd.readouterr().err
    assert f"{tmp_path / 'step_00000006'} was not resumed from: {shard}: 50 bytes" in err, err
    assert "resuming from step_00000004, the newest intact checkpoint" in err

    # `latest` names a step directory that was removed (by hand, by a cleanup): the newest intact one, said in
    # one line, not a FileNotFoundError from setting the missing directory aside (every start crashed the same)
    shutil.rmtree(tmp_path / "step_00000004")
    run_ranks(2, _resume, str(tmp_path), 2, None, timeout=120)
    said = [line for line in capfd.readouterr().err.splitlines() if "step_00000004" in line]
    assert said == [f"[numloss] warning: {tmp_path / 'latest'} names step_00000004, but {tmp_path / 'step_00000004'} "
                    "is missing. Resuming from step_00000002, the newest intact checkpoint (step_00000004 is missing)"], said
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "skipped_step_00000006", "step_00000002"]
