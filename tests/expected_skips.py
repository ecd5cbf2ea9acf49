"""The skips the suite expects, in one place, each with the condition it happens under and why it is right.

Under `CI=true` (tests/conftest.py) the run fails on
- a skip listed nowhere here (a CI image without an extra the suite tests, a host check gone wrong): the
  test, or the file skipped whole at its import, and the skip's message are named;
- a listed skip whose condition holds but whose test ran instead (the list is stale: a test that now runs
  is good news, but a list that says otherwise hides the next skip that matters).
Outside CI both are printed in the summary and fail nothing. An entry matches a node id (an `fnmatch`
pattern: a file, a test, a parametrised case) and the skip's message must contain its `reason`: the
same test skipping for another reason is unexpected.
"""

from __future__ import annotations

import fnmatch
import os
from dataclasses import dataclass
from typing import Callable


def _no_cuda() -> bool:
    import torch

    return not torch.cuda.is_available()


def _cuda() -> bool:
    return not _no_cuda()


def _not_root() -> bool:
    return os.geteuid() != 0


@dataclass(frozen=True)
class ExpectedSkip:
    nodeid: str  # fnmatch pattern of the node ids (a collected file's id is its path)
    reason: str  # text the skip's message contains
    why: str  # why skipping there is right, and what runs the case instead
    when: Callable[[], bool] = lambda: True  # the skip is expected only where this holds


EXPECTED: tuple[ExpectedSkip, ...] = (
    # ---- a CUDA GPU (the CPU machines run the same kernels under Triton's interpreter) ----
    ExpectedSkip("tests/numloss/test_fused_pass.py::test_cuda_fused_equals_eager_at_llama3_sizes[[]*[]]",
                 "needs a CUDA GPU and triton",
                 "Llama-3-sized bf16 logits on a GPU; on CPU the same Triton kernels run interpreted "
                 "(tests/numloss/fused_interpreted.py) at small sizes", when=_no_cuda),
    ExpectedSkip("tests/numloss/test_fused_pass.py::test_cuda_gradient_in_place_allocates_no_second_logits",
                 "needs a CUDA GPU and triton",
                 "CUDA allocator statistics exist only on a GPU", when=_no_cuda),
    ExpectedSkip("tests/test_gpu_check.py::test_requirements_alone_prints_the_table_and_exits_3_when_a_section_would_be_skipped",
                 "this checks the answer on a machine without a GPU",
                 "the GPU check's refusal on a CPU-only machine cannot be seen where a GPU exists", when=_cuda),
    # ---- a layout the model cannot take ----
    ExpectedSkip("tests/recipes/engines/megatron/runtime/test_convert.py::test_round_trip_bit_exact[[]1-2-2-qwen2[]]",
                 "the Qwen2 has 2 layers: no PP 2 x VP 2",
                 "PP 2 x VP 2 needs 4 layers; the Llama case of the same test runs that layout"),
    # ---- privileges: tests that need root (a tmpfs mount) and skip without it go here, `when=_not_root` ----
)


def _message(report) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:  # (path, line, "Skipped: ...")
        return str(longrepr[2])
    return str(longrepr)


def _matches(entry: ExpectedSkip, nodeid: str) -> bool:
    return fnmatch.fnmatchcase(nodeid, entry.nodeid)


class SkipLedger:
    """A pytest plugin: what the run skipped and what it ran, compared with EXPECTED at the run's end."""

    def __init__(self, expected: tuple[ExpectedSkip, ...] = EXPECTED, ci: bool = False):
        self.expected = [e for e in expected if e.when()]
        self.ci = ci
        self.skipped: dict[str, str] = {}  # node id -> message
        self.ran: set[str] = set()

    def record(self, report) -> None:
        if report.skipped and not hasattr(report, "wasxfail"):
            self.skipped.setdefault(report.nodeid, _message(report))
        elif getattr(report, "when", None) == "call":
            self.ran.add(report.nodeid)

    def unexpected(self) -> list[str]:
        return [f"{nodeid}: {message}" for nodeid, message in sorted(self.skipped.items())
                if not any(_matches(e, nodeid) and e.reason in message for e in self.expected)]

    def stale(self) -> list[str]:
        """Listed skips whose condition holds, where a matching test ran (a file entry: any test in it)."""
        out = []
        for e in self.expected:
            ran = sorted(n for n in self.ran if _matches(e, n) or _matches(e, n.split("::", 1)[0]))
            if ran:
                more = f" and {len(ran) - 1} more" if len(ran) > 1 else ""
                out.append(f"{e.nodeid} ({e.reason!r}) ran instead: {ran[0]}{more}")
        return out

    # ---- hooks ----

    def pytest_collectreport(self, report) -> None:
        if report.skipped:  # a file skipped whole at import (importorskip, a module-level mark)
            self.record(report)

    def pytest_runtest_logreport(self, report) -> None:
        self.record(report)

    def pytest_sessionfinish(self, session) -> None:
        if self.ci and (self.unexpected() or self.stale()) and session.exitstatus == 0:
            session.exitstatus = 1  # pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter) -> None:
        for title, lines in (("skips tests/expected_skips.py does not list", self.unexpected()),
                             ("expected skips that did not happen (their tests ran)", self.stale())):
            if lines:
                verdict = ": these fail the run (CI=true)" if self.ci else " (outside CI: reported only)"
                terminalreporter.section(title + verdict, sep="=", red=self.ci, yellow=not self.ci)
                for line in lines:
                    terminalreporter.line(line)
