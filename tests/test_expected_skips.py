"""tests/expected_skips.py: under CI=true an unlisted skip, or a listed one whose test ran, fails a real
pytest run (a small suite in a temporary folder, with the ledger registered as tests/conftest.py does);
outside CI both are printed and fail nothing."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.expected_skips import EXPECTED, ExpectedSkip, SkipLedger

REPO = Path(__file__).resolve().parents[1]

SUITE = {
    "conftest.py": """
        from tests.expected_skips import ExpectedSkip, SkipLedger
        import os
        EXPECTED = (ExpectedSkip("test_a.py::test_listed[[]*[]]", "no widget here", "a hand case"),
                    ExpectedSkip("test_a.py::test_listed_but_runs", "no gadget here", "a hand case"),
                    ExpectedSkip("test_gone.py", "could not import", "a file skipped at import"))
        def pytest_configure(config):
            config.pluginmanager.register(SkipLedger(EXPECTED, ci=os.environ.get("CI") == "true"), "expected-skips")
    """,
    "test_a.py": """
        import os, pytest
        @pytest.mark.parametrize("x", [1, 2])
        def test_listed(x):
            pytest.skip("no widget here")
        def test_listed_but_runs():
            if os.environ.get("SKIP_GADGET"):
                pytest.skip("no gadget here")
        def test_unlisted():
            if os.environ.get("SKIP_OTHER"):
                pytest.skip("an extra is missing")
    """,
    "test_gone.py": """
        import pytest
        pytest.importorskip("no_such_module_here")
        def test_never():
            pass
    """,
}


def run_suite(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    for name, text in SUITE.items():
        (tmp_path / name).write_text(textwrap.dedent(text))
    base = {k: v for k, v in os.environ.items() if k not in ("CI", "SKIP_GADGET", "SKIP_OTHER")}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", str(tmp_path)],
                          cwd=tmp_path, env={**base, "PYTHONPATH": str(REPO), **env},
                          capture_output=True, text=True, timeout=120)


def test_under_ci_only_the_listed_skips_pass(tmp_path):
    proc = run_suite(tmp_path, CI="true", SKIP_GADGET="1")
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "4 skipped" in proc.stdout and "does not list" not in proc.stdout, proc.stdout[-3000:]


def test_under_ci_an_unlisted_skip_fails_the_run_and_is_named(tmp_path):
    proc = run_suite(tmp_path, CI="true", SKIP_GADGET="1", SKIP_OTHER="1")
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert "skips tests/expected_skips.py does not list: these fail the run (CI=true)" in proc.stdout
    assert "test_a.py::test_unlisted: Skipped: an extra is missing" in proc.stdout, proc.stdout[-3000:]


def test_under_ci_a_listed_skip_whose_test_ran_fails_the_run(tmp_path):
    proc = run_suite(tmp_path, CI="true")  # test_listed_but_runs runs
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert "expected skips that did not happen" in proc.stdout
    assert "test_a.py::test_listed_but_runs ('no gadget here') ran instead" in proc.stdout, proc.stdout[-3000:]


def test_outside_ci_both_are_reported_and_fail_nothing(tmp_path):
    proc = run_suite(tmp_path, SKIP_OTHER="1")
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "(outside CI: reported only)" in proc.stdout and "test_a.py::test_unlisted" in proc.stdout
    assert "test_listed_but_runs ('no gadget here') ran instead" in proc.stdout


def test_a_listed_test_skipping_for_another_reason_is_unexpected():
    class Report:
        nodeid, skipped, when = "t.py::x", True, "call"
        longrepr = ("t.py", 3, "Skipped: no gizmo")

    ledger = SkipLedger((ExpectedSkip("t.py::x", "no widget", "hand case"),))
    ledger.record(Report())
    assert ledger.unexpected() == ["t.py::x: Skipped: no gizmo"]


@pytest.mark.parametrize("entry", EXPECTED, ids=lambda e: e.nodeid)
def test_every_listed_skip_names_a_collected_test_with_its_reason(entry):
    """The list's patterns match tests that exist, and each reason is the text the test skips with."""
    path = REPO / entry.nodeid.split("::", 1)[0]
    assert path.is_file(), entry.nodeid
    assert entry.reason in path.read_text(), f"{path} never says {entry.reason!r}"
    assert entry.why
