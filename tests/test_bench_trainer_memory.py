"""benchmarks/bench_trainer_memory.py at its smallest configuration (`--quick`: V 8,192, a 256-token row,
fp32): each trainer runs in a process of its own, and the table's ratio is NumericSFTTrainer's step peak over
SFTTrainer's, both measured (no timing or memory target is asserted here: the numbers belong in
docs/benchmarks.md)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

pytest.importorskip("trl")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_trainer_memory as bench  # noqa: E402


@pytest.mark.timeout(900)
def test_the_smallest_configuration_measures_both_trainers_and_their_ratio(capsys):
    rows = bench.main(["--quick", "--timeout", "800"])
    assert len(rows) == 1
    row = rows[0]
    assert row["sft_mib"] > 0 and row["numeric_mib"] > 0
    assert math.isclose(row["ratio"], row["numeric_mib"] / row["sft_mib"])
    assert row["sft_s"] > 0 and row["numeric_s"] > 0 and row["time_ratio"] > 0
    printed = capsys.readouterr().out
    assert "| V | tokens | dtype | labels |" in printed and f"| {row['ratio']:.2f} |" in printed
    assert "largest NumericSFTTrainer / SFTTrainer step peak" in printed
