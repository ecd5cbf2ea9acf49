"""recipes.training.runtime: the process set-up and teardown.

- train.dist_timeout_minutes reaches the process group recipes.train creates and Ray's TorchConfig.
  The 10-minute default of torch would end a 70B job in its checkpoint save or export (every other rank
  waits in a collective while shards are written). Not simulated: a real 141 GB export; the test reads
  the timeout the group was created with.
- setup_distributed silences torch's per-call deprecation warnings for the collectives DeepSpeed's ZeRO
  uses, and nothing else (a 60-step run wrote ~30,000 of them into its log).
- clear_method_caches frees the instances a method's `lru_cache` keeps.
- megatron-core is imported without its wandb import (~0.8 s of a rank's start-up; DeepSpeed's start:
  tests/recipes/engines/deepspeed/runtime/test_distributed.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from recipes.config import recipe_from_dict

REPO = Path(__file__).resolve().parents[3]
BASE = {"model": {"config": {"model_type": "llama"}, "tokenizer": "t"}, "data": {"train": "d"}}


def test_the_process_group_gets_the_recipes_timeout():
    code = ("import torch, torch.distributed as dist; from recipes.training.runtime import setup_distributed, teardown; "
            "setup_distributed(timeout_minutes=61.5); "
            "b = dist.distributed_c10d._get_default_group()._get_backend(torch.device('cpu')); "
            "print('TIMEOUT', b.options._timeout.total_seconds()); teardown()")
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(REPO)}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "TIMEOUT 3690.0" in out.stdout, out.stdout


def test_default_is_60_minutes_and_ray_gets_it():
    pytest.importorskip("ray")
    from launch.ray import torch_config

    recipe = recipe_from_dict(BASE)
    assert recipe.train.dist_timeout_minutes == 60.0
    assert torch_config(recipe).timeout_s == 3600
    assert torch_config(recipe_from_dict(BASE, ["train.dist_timeout_minutes=90"])).timeout_s == 5400
    with pytest.raises(ValueError, match="train.dist_timeout_minutes"):
        recipe_from_dict(BASE, ["train.dist_timeout_minutes=0"])


SCRIPT = """
import sys, warnings, torch, torch.distributed as dist
from recipes.training.runtime import free_port, setup_distributed, teardown
if sys.argv[1] == "quiet":
    setup_distributed()
else:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
x, out = torch.ones(4), torch.empty(4)
for _ in range(3):
    with warnings.catch_warnings():  # as code elsewhere in a training step does: resets "shown once"
        pass
    dist.all_gather_into_tensor(out, x)
    dist.reduce_scatter_tensor(out, x)
warnings.warn("another FutureWarning", FutureWarning)
teardown()
"""


def _stderr(mode: str) -> str:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(REPO)}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "PYTHONWARNINGS"):
        env.pop(key, None)
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stderr


def test_zero_collectives_deprecations_are_silenced_and_other_warnings_are_not():
    loud = _stderr("loud")
    assert loud.count("is deprecated") >= 6  # without the filter: every call warns
    quiet = _stderr("quiet")
    assert "is deprecated" not in quiet and "another FutureWarning" in quiet


def test_clear_method_caches_frees_what_a_method_cache_keeps():
    """An `lru_cache` on a method, under a decorator that hides it in a closure (as DeepSpeed's NVTX
    wrapper does), keeps every instance alive until `clear_method_caches` is given the class or a
    subclass; a cache on an unrelated class stays. Two such caches (ZeRO-3's parameter coordinator,
    megatron-core's RotaryEmbedding) held process groups past a run's end
    (tests/recipes/test_train_layouts.py, test_no_process_group_outlives_a_run)."""
    import functools
    import gc
    import weakref

    from recipes.training.runtime import clear_method_caches

    def hide(fn):
        def wrapper(*args):
            return fn(*args)
        return wrapper

    class Base:
        @hide
        @functools.lru_cache(maxsize=None)
        def cached(self, x):
            return x + 1

    class Child(Base):
        pass

    class Other:
        @functools.lru_cache(maxsize=None)
        def cached(self, x):
            return x

    child, other = Child(), Other()
    assert child.cached(1) == 2 and other.cached(3) == 3
    child_ref, other_ref = weakref.ref(child), weakref.ref(other)
    del child, other
    gc.collect()
    assert child_ref() is not None and other_ref() is not None  # the caches keep both
    clear_method_caches([Child])
    gc.collect()
    assert child_ref() is None and other_ref() is not None


def test_megatron_core_is_imported_without_wandb_and_wandb_stays_importable():
    pytest.importorskip("megatron.core")
    pytest.importorskip("wandb")
    code = ("import sys; from recipes.training.runtime import import_without; import_without('megatron.core', 'wandb'); "
            "loaded = 'wandb' in sys.modules; import megatron.core.timers as t; import wandb; "
            "print(loaded, t.wandb, wandb.__name__)")
    assert _python(code).stdout.split()[-3:] == ["False", "None", "wandb"]


def _python(code: str, ok: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert (out.returncode == 0) == ok, out.stderr[-3000:]
    return out


EXIT_PROBE = """
import atexit, os, sys, threading, time
from pathlib import Path
from recipes.training.runtime import exit_finished

out = Path(sys.argv[1])

class Finalised:  # says so when the interpreter's finalisation frees it (what it calls bound early)
    def __del__(self, path=str(out / "finalised"), open_=os.open, close=os.close, flags=os.O_CREAT | os.O_WRONLY):
        close(open_(path, flags))

kept = Finalised()
atexit.register(lambda: out.joinpath("exit_handler").write_text("ran"))
print("flushed last", end="")  # no newline: only a flush writes it out
if sys.argv[2] == "thread":  # a non-daemon thread still at work: a normal exit joins it
    threading.Thread(target=lambda: (time.sleep(0.5), out.joinpath("thread").write_text("done"))).start()
exit_finished(0)
"""


@pytest.mark.parametrize("case", ["clean", "thread"])
def test_a_finished_run_exits_without_finalisation_only_where_nothing_is_lost(tmp_path, case):
    """exit_finished: the exit handlers run and the output is flushed; the interpreter's finalisation is
    skipped (an object freed by it says nothing), unless a non-daemon thread is still running: then the
    normal exit joins it (its file is written) and finalises."""
    out = subprocess.run([sys.executable, "-c", EXIT_PROBE, str(tmp_path), case], cwd=REPO, capture_output=True,
                         text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0 and out.stdout == "flushed last", (out.returncode, out.stdout, out.stderr[-2000:])
    assert (tmp_path / "exit_handler").read_text() == "ran"
    if case == "clean":
        assert not (tmp_path / "finalised").exists()
    else:
        assert (tmp_path / "thread").read_text() == "done" and (tmp_path / "finalised").exists()
