"""`recipes.engines.megatron.pure.kernels`: the layer spec and fused kernels, decided from what imports, asked "as
if" Transformer Engine and apex were present (they cannot be installed on this CPU machine); the real probe
as it answers where TE is absent or half there (asked as if on CUDA); and what of
the GPU configuration megatron-core's own code can show on CPU (one gloo process):

- megatron's local spec saves its norms under the TE spec's names (its `sharded_state_dict_keys_map`),
  exactly the names `convert.te_name` gives, so a distributed checkpoint is the same under both specs;
- megatron's fused SwiGLU and fused bias-dropout-add, which the GPU plan turns on, give the unfused
  model's loss and gradients (run eagerly: `torch.compile`, their jit, would compile C++ on a CPU).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re
from pathlib import Path

import pytest
import torch

from recipes.config import MegatronSection
from recipes.engines.megatron.pure.kernels import (
    APEX_GRAD_ACCUM_MODULE,
    LOCAL_SPEC,
    TE_INSTALL,
    TE_MODULE,
    TE_PACKAGE,
    TE_SPEC,
    plan_kernels,
    te_available,
    te_missing,
)
from tests.recipes.engines.megatron.helpers import VOCAB, recipe_for, run_ranks, save_tiny

if importlib.util.find_spec("megatron.core") is None:
    raise ImportError("tests/recipes/engines/megatron needs megatron-core (pip install -e '.[megatron]')")

ON_GPU = ("gradient_accumulation_fusion", "bias_activation_fusion", "bias_dropout_fusion", "apply_rope_fusion")


def test_cpu_plan_is_the_local_spec_with_every_fusion_off():
    plan = plan_kernels(MegatronSection(), cuda=False)
    assert plan.spec == LOCAL_SPEC and plan.packing == "mask" and not plan.te
    assert not any(plan.fusions.values()) and not any(plan.ddp.values())
    assert plan.why_off["apply_rope_fusion"] == "no CUDA" and plan.why_off["overlap_grad_reduce"] == "needs CUDA streams"
    assert plan.describe().startswith("layer spec local (auto: no GPU); on: none; off: gradient_accumulation_fusion, "
                                      "bias_activation_fusion, bias_dropout_fusion, apply_rope_fusion (no CUDA); ")
    assert plan.describe().endswith("; packed rows: block mask")


def test_plan_as_if_transformer_engine_and_apex_were_present():
    plan = plan_kernels(MegatronSection(), cuda=True, can_import=lambda module: True)
    assert plan.spec == TE_SPEC and plan.te and plan.packing == "thd"
    assert {name for name, on in plan.fusions.items() if on} == set(ON_GPU)
    assert plan.ddp == {"use_distributed_optimizer": True, "overlap_grad_reduce": True, "overlap_param_gather": True}
    line = plan.describe()
    assert line.startswith("layer spec transformer_engine (auto: Transformer Engine on CUDA); on: gradient_accumulation_fusion, bias_activation_fusion, "
                           "bias_dropout_fusion, apply_rope_fusion, use_distributed_optimizer, overlap_grad_reduce, "
                           "overlap_param_gather; off: masked_softmax_fusion (TE attention has its own softmax); ")
    assert line.endswith("packed rows: THD (cu_seqlens)")
    # without the distributed optimizer the param gather has nothing to overlap
    plan = plan_kernels(MegatronSection(distributed_optimizer=False), cuda=True, can_import=lambda module: True)
    assert plan.ddp == {"use_distributed_optimizer": False, "overlap_grad_reduce": True, "overlap_param_gather": False}
    assert plan.why_off["overlap_param_gather"] == "needs the distributed optimizer"


def test_each_fusion_needs_what_it_imports():
    no_apex = plan_kernels(MegatronSection(), cuda=True, can_import=lambda module: module != APEX_GRAD_ACCUM_MODULE)
    assert no_apex.te and not no_apex.fusions["gradient_accumulation_fusion"] and no_apex.fusions["apply_rope_fusion"]
    assert APEX_GRAD_ACCUM_MODULE in no_apex.why_off["gradient_accumulation_fusion"]
    no_te = plan_kernels(MegatronSection(), cuda=True, can_import=lambda module: module != TE_MODULE)
    assert no_te.spec == LOCAL_SPEC and no_te.packing == "mask"
    assert {name for name, on in no_te.fusions.items() if on} == set(ON_GPU) - {"apply_rope_fusion"}
    assert no_te.why_off["masked_softmax_fusion"] == "would drop the packed-rows mask"
    # megatron.transformer_impl, as Megatron-LM's --transformer-impl
    forced = plan_kernels(MegatronSection(transformer_impl="local"), cuda=True, can_import=lambda module: True)
    assert forced.spec == LOCAL_SPEC and not forced.fusions["apply_rope_fusion"]
    with pytest.raises(ValueError, match="transformer_engine needs CUDA and Transformer Engine"):
        plan_kernels(MegatronSection(transformer_impl="transformer_engine"), cuda=True, can_import=lambda m: False)
    with pytest.raises(ValueError, match="no GPU"):
        plan_kernels(MegatronSection(transformer_impl="transformer_engine"), cuda=False)


def test_the_real_probe_without_transformer_engine_picks_the_local_spec_on_cuda():
    """This machine has megatron-core and no TE: megatron-core's TE extension imports anyway (HAVE_TE False),
    so a probe that imports the extension alone would pick a spec whose classes are undefined. Asked as if on
    CUDA, the real probe picks the local spec and says why; an explicit TE spec is refused naming the key and
    what to install."""
    assert importlib.util.find_spec("transformer_engine") is None, "this test is about a machine without TE"
    importlib.import_module(TE_MODULE)  # the extension imports without TE: the trap the probe must not fall in
    why = te_missing()
    assert why is not None and why.startswith(f"{TE_PACKAGE} does not import (ModuleNotFoundError: ")
    assert not te_available()
    plan = plan_kernels(MegatronSection(), cuda=True)
    assert plan.spec == LOCAL_SPEC and plan.packing == "mask" and not plan.fusions["apply_rope_fusion"]
    assert plan.describe().startswith(f"layer spec local (auto: {why}); on: bias_activation_fusion, bias_dropout_fusion")
    with pytest.raises(ValueError) as refused:
        plan_kernels(MegatronSection(transformer_impl="transformer_engine"), cuda=True)
    text = str(refused.value)
    assert text.startswith("megatron.transformer_impl: transformer_engine needs CUDA and Transformer Engine")
    assert TE_INSTALL in text and "auto or local" in text and TE_PACKAGE in text


_HALF_TE = """
from recipes.engines.megatron.pure.kernels import te_missing
print("WHY", te_missing())
"""


def test_the_real_probe_names_a_half_installed_transformer_engine(tmp_path):
    """A TE whose package imports but is not whole (here a stand-in `transformer_engine` with its metadata and an
    empty `pytorch` package, in a fresh interpreter): megatron-core's TE extension fails to import, and the probe
    says so with the error rather than raising or picking the TE spec."""
    import os
    import subprocess
    import sys

    site = tmp_path / "site"
    (site / "transformer_engine" / "pytorch").mkdir(parents=True)
    (site / "transformer_engine" / "__init__.py").write_text("")
    (site / "transformer_engine" / "pytorch" / "__init__.py").write_text("")
    (site / "transformer_engine-2.9.0.dist-info").mkdir()
    (site / "transformer_engine-2.9.0.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: transformer-engine\nVersion: 2.9.0\n")
    repo = str(Path(__file__).resolve().parents[5])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), repo])}
    out = subprocess.run([sys.executable, "-c", _HALF_TE], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"WHY {TE_MODULE} does not import (ModuleNotFoundError: No module named 'transformer_engine.pytorch." \
        in out.stdout, out.stdout


def test_the_real_probe_reads_the_extensions_have_te(monkeypatch):
    """TE's package imports and megatron-core's extension imports too, but the extension found no TE (its
    HAVE_TE False, as when TE's fp8 module fails to import): the probe reads the flag, not the imports alone."""
    import sys
    import types

    monkeypatch.setitem(sys.modules, TE_PACKAGE, types.ModuleType(TE_PACKAGE))
    monkeypatch.setitem(sys.modules, TE_MODULE, types.SimpleNamespace(HAVE_TE=False))
    assert te_missing() == f"{TE_MODULE} imports but found no Transformer Engine (its HAVE_TE is False)"
    assert plan_kernels(MegatronSection(), cuda=True).spec == LOCAL_SPEC
    monkeypatch.setitem(sys.modules, TE_MODULE, types.SimpleNamespace(HAVE_TE=True))
    assert te_missing() is None and plan_kernels(MegatronSection(), cuda=True).spec == TE_SPEC


def test_megatron_core_takes_the_gpu_flags(tmp_path):
    """The flags go into megatron-core's TransformerConfig as they are; the one that needs TE is refused by
    megatron-core itself here (its own check), so a GPU without TE could never get it by mistake."""
    from transformers import AutoConfig

    from recipes.engines.megatron.runtime.convert import transformer_config_from_hf

    hf_config = AutoConfig.from_pretrained(str(save_tiny("llama", tmp_path / "llama")))
    no_te = plan_kernels(MegatronSection(), cuda=True, can_import=lambda module: module != TE_MODULE)
    config = transformer_config_from_hf(hf_config, fusions=no_te.fusions)
    assert all(getattr(config, name) == on for name, on in no_te.fusions.items())
    te = plan_kernels(MegatronSection(), cuda=True, can_import=lambda module: True)
    with pytest.raises(ValueError, match="apply_rope_fusion is not available"):
        transformer_config_from_hf(hf_config, fusions=te.fusions)
    with pytest.raises(ValueError, match="unknown flags"):
        transformer_config_from_hf(hf_config, fusions={"fused_everything": True})


def _one_rank(rank, world, llama_dir):
    from megatron.core import parallel_state

    from recipes.engines.megatron.runtime.convert import te_name
    from recipes.engines.megatron.runtime.model import build_model_chunks, initialize_model_parallel

    recipe = recipe_for(llama_dir)
    initialize_model_parallel(recipe)
    cpu = plan_kernels(recipe.megatron, cuda=False)
    (plain,) = build_model_chunks(recipe, cpu)
    # megatron's own keys in a distributed checkpoint (layers stacked: no layer number) are the TE spec's
    # names for the norms, which `te_name` gives
    sharded = plain.sharded_state_dict()
    for name, _ in plain.named_parameters():
        assert sharded[name].key == re.sub(r"^decoder\.layers\.\d+\.", "decoder.layers.", te_name(name)), name
    assert sharded["decoder.layers.0.input_layernorm.weight"].key == "decoder.layers.self_attention.linear_qkv.layer_norm_weight"

    torch.compiler.set_stance("force_eager")
    fused_flags = {**cpu.fusions, "bias_activation_fusion": True, "bias_dropout_fusion": True}
    (fused,) = build_model_chunks(recipe, dataclasses.replace(cpu, fusions=fused_flags))
    assert fused.config.bias_activation_fusion and fused.config.bias_dropout_fusion
    g = torch.Generator().manual_seed(3)
    ids, labels = torch.randint(0, VOCAB, (2, 12), generator=g), torch.randint(0, VOCAB, (2, 12), generator=g)
    grads, losses = [], []
    for model in (plain, fused):
        model.train()
        logits = model(ids, torch.arange(12)[None].expand(2, 12), None)
        loss = torch.nn.functional.cross_entropy(logits[..., :VOCAB].reshape(-1, VOCAB), labels.reshape(-1))
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-6, atol=1e-6)
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-5, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")
    parallel_state.destroy_model_parallel()


def test_on_cpu_the_local_spec_saves_te_names_and_the_megatron_fusions_change_nothing(tmp_path):
    run_ranks(1, _one_rank, save_tiny("llama", tmp_path / "llama"), timeout=240)
