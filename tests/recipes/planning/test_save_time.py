"""A stop request's save against the shutdown time a cluster gives it (recipes/planning/save_time.py): the
numbers below are computed by hand from the module's rule (step + 2 x bytes / bandwidth + 30 s)."""

from __future__ import annotations

import pytest

from recipes.planning.save_time import (
    needed_shutdown_timeout_s,
    save_s,
    shutdown_warnings,
    stop_s,
    torchrun_shutdown_timeout_s,
)


def test_the_save_writes_and_reads_back_every_byte():
    assert save_s(1e12, 10.0) == pytest.approx(200.0)  # 1 TB out and back in at 10 GB/s
    assert stop_s(1e12, 10.0, 10.0) == pytest.approx(240.0)  # + the step + 30 s of teardown
    assert needed_shutdown_timeout_s(1e12, 10.0, 10.0) == 240
    assert needed_shutdown_timeout_s(2e12, 10.0, 10.0) == 480  # 440 s, in whole minutes
    assert torchrun_shutdown_timeout_s(0) == 300 and torchrun_shutdown_timeout_s(600) == 600


def test_a_save_longer_than_the_templates_shutdown_timeout_is_a_warning():
    assert shutdown_warnings(1e12, 10.0, 10.0, preempt_notice_s=300) == []  # 240 s of 300
    (warning,) = shutdown_warnings(2e12, 10.0, 10.0, preempt_notice_s=300)  # 440 s
    assert "takes ~440 s" in warning and "TORCH_ELASTIC_SHUTDOWN_TIMEOUT 300 s" in warning
    assert "raise cluster.preempt_notice_s to 480" in warning
    assert shutdown_warnings(2e12, 10.0, 10.0, preempt_notice_s=480) == []


def test_without_the_notice_only_killwait_is_left_and_a_short_notice_is_named():
    (warning,) = shutdown_warnings(1e11, 10.0, 10.0, preempt_notice_s=0)  # 60 s against KillWait's 30
    assert "KillWait (30 s by default)" in warning and "set cluster.preempt_notice_s to 60" in warning
    (warning,) = shutdown_warnings(1e12, 10.0, 10.0, preempt_notice_s=100)  # 240 s against a 100 s notice
    assert "cluster.preempt_notice_s: 100 s" in warning and "raise it to 240" in warning


def test_a_plan_without_a_size_or_a_time_is_not_judged():
    assert shutdown_warnings(None, 10.0, 10.0, 300) == []
    assert shutdown_warnings(1e15, float("inf"), 10.0, 300) == []


def test_validate_warns_when_a_shipped_recipes_save_cannot_fit():
    """Mixtral-8x22B on 8 x 8 GPUs: ~1.97 TB per checkpoint, ~426 s from a stop request to the exit at the
    planner's 10 GB/s, past the templates' 300 s default; the shipped recipe's 480 s notice (and so timeout)
    fits."""
    from pathlib import Path

    from recipes.validation import validate

    recipe = Path(__file__).resolve().parents[3] / "recipes" / "configs" / "scale" / "mixtral-8x22b-8x8.yaml"
    rep = validate.validate_recipe(recipe, ["cluster.preempt_notice_s=300"], offline=True)
    (warning,) = [w for w in rep.warnings if "TORCH_ELASTIC_SHUTDOWN_TIMEOUT" in w]
    assert "raise cluster.preempt_notice_s to 480" in warning and "1,969 GB" in warning, warning
    shipped = validate.validate_recipe(recipe, [], offline=True)
    assert not [w for w in shipped.warnings if "preempt_notice_s" in w]
