"""A write that fails ends the run with exit 74, naming the path, the cause and the free space, on a REAL full
disk (a small tmpfs as `train.out_dir`; no function replaced): `recipes.reliability.checkpoint_writes`
(the checkpoint) and `recipes.reliability.export_writer` (the export), through `python -m recipes.train`.

On each engine (one process each start; Megatron's dist_checkpointing writes from processes of its own, whose
errors come back as torch's `CheckpointException`, a `BaseException`), in one run directory on a tmpfs:
1. steps 1-2 saved and exported (measured: the checkpoint's and the export's size on this disk);
2. a file fills the disk to half a checkpoint's room; steps 3-4: step 4's save fails: exit 74, the staging
   directory named with "the disk is full" and the free space, `latest` still step 2, nothing of step 4
   left, `final/` file for file the step-2 export;
3. room for the checkpoint and a third of the export: step 4 saves, the export fails: exit 74, the same
   words, `final/` unchanged, `latest` step 4;
4. the file removed, the same command: the export is written (it records step 4), exit 0 (DeepSpeed; what
   that start does is the engine-neutral resume policy's).
And a save onto a read-only filesystem (2 gloo ranks): exit 74's message says nothing was written.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.distributed import run_ranks
from tests.recipes.torchrun_helpers import REPO, tiny_workspace

pytestmark = pytest.mark.timeout(600)

MOUNT_NEEDS = "a real full disk is a small tmpfs, and mounting one (mount -t tmpfs) needs root or CAP_SYS_ADMIN"


@contextlib.contextmanager
def tmpfs(where: Path, size: str, *options: str):
    """A tmpfs of `size` mounted at `where` for the block; skips, saying what it needs, where it cannot."""
    where.mkdir(parents=True, exist_ok=True)
    mount = shutil.which("mount")
    if mount is None:
        pytest.skip(f"{MOUNT_NEEDS}: no mount command here")
    done = subprocess.run([mount, "-t", "tmpfs", "-o", ",".join([f"size={size}", *options]), "tmpfs", str(where)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"{MOUNT_NEEDS}; here it failed (uid {os.geteuid()}): {done.stderr.strip() or done.returncode}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def _start(recipe: Path, out: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "recipes.train", str(recipe), f"train.out_dir={out}", *overrides],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def _bytes(path: Path) -> int:
    """What `path` takes on its filesystem (allocated blocks, as the free space counts them)."""
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    return sum(p.stat().st_blocks * 512 for p in files)


def _fill(disk: Path, leave: int) -> None:
    """Grow or shrink `disk/filler` so that `leave` bytes stay free."""
    filler = disk / "filler"
    have = filler.stat().st_size if filler.exists() else 0
    size = max(0, have + shutil.disk_usage(disk).free - leave)
    with open(filler, "ab") as fh:
        fh.truncate(size)
    with open(filler, "r+b") as fh:  # tmpfs allocates what is written, not what is truncated to
        fh.seek(have)
        while fh.tell() < size:
            fh.write(b"\0" * min(1 << 20, size - fh.tell()))


def _digest(directory: Path) -> dict[str, str]:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def _exported_step(final: Path) -> int:
    return json.loads((final / "numloss_export.json").read_text())["step"]


@pytest.fixture(scope="module")
def recipe(tmp_path_factory):
    pytest.importorskip("deepspeed")
    root = tmp_path_factory.mktemp("writes")
    return tiny_workspace(root, problems=32, max_digits=2, hidden=32,
                          train={"steps": 2, "micro_batch_size": 2, "save_every": 2, "keep_last": 3,
                                 "tensorboard": False})


@pytest.mark.parametrize("engine", ["deepspeed", "megatron"])
def test_a_full_disk_at_a_save_and_at_the_export_exits_74_naming_the_disk_and_loses_nothing(recipe, tmp_path, engine):
    if engine == "megatron":
        pytest.importorskip("megatron.core")
    with tmpfs(tmp_path / "disk", "8m") as disk:
        out, engine_key = disk / "run", f"train.engine={engine}"
        checkpoints, final = out / "checkpoints", out / "final"

        first = _start(recipe, out, engine_key)
        assert first.returncode == 0, first.stderr[-3000:]
        checkpoint, export = _bytes(checkpoints / "step_00000002"), _bytes(final)
        exported = _digest(final)

        # 2. room for half a checkpoint: step 4's save fails
        _fill(disk, checkpoint // 2)
        before = shutil.disk_usage(disk).free
        full = _start(recipe, out, engine_key, "train.steps=4")
        assert full.returncode == 74, full.stderr[-3000:]
        said = full.stderr
        assert f"checkpoint step 4 was not saved: rank 0 could not write {checkpoints / '.step_00000004.partial'}" in said
        assert "(the disk is full: " in said and f" free of 8.00 MiB on that filesystem (" in said, said[-3000:]
        assert "Traceback" not in said and "`latest` names step_00000002" in said, said[-3000:]
        assert (checkpoints / "latest").read_text() == "step_00000002"
        assert sorted(p.name for p in checkpoints.glob("*step_*")) == ["step_00000002"]
        assert _digest(final) == exported and _exported_step(final) == 2
        overhead = max(0, before - shutil.disk_usage(disk).free)  # what the start kept (metrics, history)

        # 3. room for the checkpoint and a third of the export: the export fails
        _fill(disk, checkpoint + overhead + export // 3)
        full = _start(recipe, out, engine_key, "train.steps=4")
        assert full.returncode == 74, full.stderr[-3000:]
        said = full.stderr
        assert f" to {final}: writing the shards failed" in said and " on 1 rank(s); rank 0: the disk is full: " in said, said[-3000:]
        assert f" free of 8.00 MiB on that filesystem (" in said and f"the previous {final} is unchanged" in said
        assert "Traceback" not in said and "free space and run the same command" in said, said[-3000:]
        assert (checkpoints / "latest").read_text() == "step_00000004"
        assert _digest(final) == exported and not (out / ".final.partial").exists()
        if engine == "megatron":
            return  # the start after a failed export is engine-neutral (the resume policy): DeepSpeed's shows it

        # 4. space again: the same command writes the export of step 4
        (disk / "filler").unlink()
        done = _start(recipe, out, engine_key, "train.steps=4")
        assert done.returncode == 0, done.stderr[-3000:]
        assert _exported_step(final) == 4 and _digest(final) != exported


def _save_on_a_read_only_disk(rank, world, root: str):
    from recipes.reliability.checkpoints import CheckpointDirs, CheckpointSaveFailed
    from recipes.training.runtime import Runtime

    class Data:
        def state_dict(self):
            return {"samples": 0}

    def save(directory: Path):
        torch.save({"weights": torch.zeros(8)}, directory / f"model_rank{rank}.pt")
        dist.barrier()

    dirs = CheckpointDirs(Path(root) / "checkpoints", keep_last=2, runtime=Runtime(rank, world, rank, torch.device("cpu")))
    with pytest.raises(CheckpointSaveFailed) as err:
        dirs.save(2, Data(), save, {})
    message = str(err.value)
    staging = Path(root) / "checkpoints" / ".step_00000002.partial"
    assert f"rank 0 could not write {staging} (the filesystem is read-only: OSError: [Errno 30]" in message, message
    assert "Nothing of it was written. This run has no checkpoint yet" in message, message
    assert "was removed" not in message and "rank 1 could not" not in message, message


def test_a_save_refused_by_a_read_only_filesystem_says_nothing_was_written(tmp_path):
    with tmpfs(tmp_path / "disk", "1m", "ro") as disk:
        run_ranks(2, _save_on_a_read_only_disk, str(disk), timeout=120)
