"""recipes.engines.deepspeed.runtime.distributed: a DeepSpeed rank's start. The group made through deepspeed.comm
has the recipe's timeout; DeepSpeed is imported without mlflow and ZeRO asks a stand-in for its Muon module
(which compiles kernels at import): together ~4-6 of a DeepSpeed rank's ~12-16 CPU s of start-up."""

from __future__ import annotations

import pytest

from tests.recipes.training.test_runtime import _python


def test_the_deepspeed_process_group_gets_the_recipes_timeout():
    pytest.importorskip("deepspeed")
    code = ("import torch, torch.distributed as dist; from recipes.engines.deepspeed.runtime.engine import DeepSpeedEngine; "
            "from recipes.training.runtime import teardown; DeepSpeedEngine.join_process_group(61.5); import deepspeed; "
            "b = dist.distributed_c10d._get_default_group()._get_backend(torch.device('cpu')); "
            "print('TIMEOUT', b.options._timeout.total_seconds(), deepspeed.comm.is_initialized()); teardown()")
    assert "TIMEOUT 3690.0 True" in _python(code).stdout


def test_deepspeed_is_imported_without_mlflow_and_mlflow_stays_importable():
    """DeepSpeed's autotuner imports mlflow at module load when it is installed (~2 CPU s a rank); the
    runtime's import hides it for that import only."""
    pytest.importorskip("deepspeed")
    pytest.importorskip("mlflow")
    code = ("import sys; from recipes.engines.deepspeed.runtime.distributed import import_deepspeed; import_deepspeed(); "
            "loaded = 'mlflow' in sys.modules; import deepspeed.autotuning.autotuner as a; import mlflow; "
            "print(loaded, a.has_mlflow, mlflow.__name__)")
    out = _python(code)
    assert out.stdout.split()[-3:] == ["False", "False", "mlflow"], out.stdout


def test_zero_asks_a_muon_stand_in_and_compiles_no_kernels():
    """ZeRO's optimizer check and its optimizers import DeepSpeed's Muon for an isinstance test; the real
    module compiles kernels at import (torch._inductor). After the engine's import, ZeRO's check takes
    AdamW without loading torch._inductor.compile_fx (what torch.compile imports), and building the stand-in Muon says why it is absent."""
    pytest.importorskip("deepspeed")
    code = ("import sys, torch; from recipes.engines.deepspeed.runtime.engine import DeepSpeedEngine; "
            "DeepSpeedEngine.join_process_group(60); from deepspeed.runtime.zero.utils import is_zero_supported_optimizer; "
            "from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam; "
            "adamw = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))]); "
            "print('SUPPORTED', is_zero_supported_optimizer(adamw), 'torch._inductor.compile_fx' in sys.modules); "
            "MuonWithAuxAdam()")
    out = _python(code, ok=False)
    assert "SUPPORTED True False" in out.stdout, out.stdout + out.stderr[-3000:]
    assert "DeepSpeed's Muon is not available in a numloss recipe" in out.stderr, out.stderr[-3000:]
