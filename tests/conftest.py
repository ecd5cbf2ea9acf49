"""How `make test` splits the suite over two pytest-xdist workers (`-n 2 --dist loadfile`).

Most of the suite's time is real launches (torchrun ranks, Ray workers) whose imports run on one core,
so a single pytest process leaves the second core idle much of the time. Two workers fill it, with a
unit of work that is a whole file, except tests/launch, which is one unit:
- a file runs whole on one worker: module fixtures (test_train_layouts' runs, a tiny model saved once)
  are built once, not once per worker;
- every test under tests/launch runs on the same worker: they share one simulated Ray cluster
  (package fixture), and two Ray instances on one host confuse Ray's address discovery ("Found multiple
  active Ray instances") and collide on a head's fixed default ports.
xdist's `loadgroup` mode would express the second rule with marks, but it renames node ids through an
attribute pytest 9 no longer reads, so the marks group nothing; this file gives xdist its scheduler
instead (`pytest_xdist_make_scheduler`, a documented xdist hook).

The longest units are handed out first (a long one started last leaves the other worker idle while it
runs); xdist's own order, the units with the most tests first, is turned off for this one, since the
count of tests says little about their time (tests/launch has fewer tests than several unit-test
files and the most CPU time). With two workers the order of the longest units sets the tail: a
100-200 s file handed out last (test_gpu_check.py is collected near the end) finishes alone. Without
xdist (`pytest tests/...`) nothing here applies.

Skips: every skip of the run is compared with tests/expected_skips.py at its end; under `CI=true` a skip
not listed there, or a listed one whose test ran instead, fails the run (that file says why).
"""

from __future__ import annotations

import os

import pytest

from tests.expected_skips import SkipLedger

# the units over ~90 s, longest first, each file run alone (`python -m pytest -q --durations=0 <file>`) on the
# shared 2-core machine, 2026-12-08, after the runs whose properties are numbers moved into pre-started ranks:
# tests/launch (test_ray + test_sweep alone 356 s, the SLURM files besides), test_train_layouts 153,
# test_engine_moe 151, test_gpu_check 141, test_train_final 106, test_train 99-107, the DeepSpeed test_moe
# 103, test_resume_policy 87 (then test_train_length_bucketing 78, test_lora 67, test_preemption 65,
# test_eval_step_in_training 55)
LONGEST_FIRST = (
    "tests/launch",
    "tests/recipes/test_train_layouts.py",
    "tests/recipes/engines/megatron/runtime/test_engine_moe.py",
    "tests/test_gpu_check.py",
    "tests/recipes/test_train_final.py",
    "tests/recipes/test_train.py",
    "tests/recipes/engines/deepspeed/runtime/test_moe.py",
    "tests/recipes/reliability/test_resume_policy.py",
)


def unit_of(nodeid: str) -> str:
    """The unit of work a test belongs to: its file, or tests/launch for every test under it."""
    path = nodeid.split("::", 1)[0]
    return "tests/launch" if path.startswith("tests/launch/") else path


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadfile":  # another mode asked for by name: xdist's own
        return None
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False  # xdist would hand out the units with the most tests first

    class ByUnit(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

    return ByUnit(config, log)


def pytest_collection_modifyitems(config, items):
    if not hasattr(config, "workerinput"):  # not an xdist worker: a plain run keeps the collected order
        return
    rank = {unit: i for i, unit in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(unit_of(item.nodeid), len(rank)))  # stable: a unit keeps its order


def pytest_configure(config):
    # where every report arrives: the xdist controller, or the one process of a plain run
    if not hasattr(config, "workerinput"):
        config.pluginmanager.register(SkipLedger(ci=os.environ.get("CI") == "true"), "expected-skips")
