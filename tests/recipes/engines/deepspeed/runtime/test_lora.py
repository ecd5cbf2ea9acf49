"""LoRA in the recipes (`model.lora`): 2-rank DeepSpeed runs on CPU (gloo; the loop in pre-started ranks,
`run_in_ranks`: the properties are numbers) of a tiny Llama
saved as a pretrained base, adapters on q_proj and v_proj, the numeric objective (SMMD + NTL).

- ZeRO-3: the checkpoints hold the adapters only; the merged export keeps every frozen weight of the
  base bit-identical and writes each adapted weight as base + alpha/r · B A (B, A from the adapter
  export); transformers loads it and PEFT's adapter on the base gives the same logits;
- ZeRO-2 logs ZeRO-3's losses and exports the same weights;
- a run stopped at its step-2 checkpoint and restarted logs the uninterrupted run's steps 3-4 to the bit;
- recipe checks: the Megatron engine, AutoTP and an adapted lm_head under the chunked head are refused.
"""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("deepspeed")
pytest.importorskip("peft")

from tests.recipes.torchrun_helpers import read_metrics, run_in_ranks, tiny_workspace  # noqa: E402

STEPS, R, ALPHA = 4, 4, 8.0
ADAPTED = ("q_proj", "v_proj")
KEYS = ("loss", "ce", "term/smmd", "term/ntl_was", "grad_norm", "lr")


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    lora = {"r": R, "alpha": ALPHA, "target_modules": list(ADAPTED), "export_merged": True}
    return root, tiny_workspace(root, problems=64, max_digits=3, module="add_or_sub", terms=("smmd", "ntl_was"),
                                lora=lora, optim={"lr": 1e-2, "schedule": "constant"},
                                train={"steps": STEPS, "micro_batch_size": 4, "grad_accum": 2, "save_every": 2,
                                       "keep_last": 2, "tensorboard": False})


@pytest.fixture(scope="module")
def zero3_run(workspace):
    root, recipe = workspace
    run_in_ranks(recipe, root / "zero3")
    return root / "zero3"


def _base_state(root) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(root / "base" / "model.safetensors"))


def _adapter(run) -> dict[str, torch.Tensor]:
    """The adapter export's A and B by the base weight's key (PEFT's keys: base_model.model.<module>.lora_A.weight)."""
    from safetensors.torch import load_file

    out = {}
    for key, value in load_file(str(run / "final" / "adapter" / "adapter_model.safetensors")).items():
        module, kind = key.removeprefix("base_model.model.").rsplit(".lora_", 1)
        out.setdefault(f"{module}.weight", {})[kind.split(".")[0]] = value
    return out


def _check_merged_export(root, run) -> dict[str, torch.Tensor]:
    from recipes.reliability.export_writer import read_export

    base, merged, adapter = _base_state(root), read_export(run / "final"), _adapter(run)
    assert set(merged) == set(base)
    assert set(adapter) == {k for k in base if k.rsplit(".", 2)[-2] in ADAPTED}
    for key, weight in base.items():
        if key not in adapter:  # frozen and not adapted: the base's own weights, to the bit
            assert torch.equal(merged[key], weight), key
            continue
        a, b = adapter[key]["A"], adapter[key]["B"]
        assert a.shape == (R, weight.shape[1]) and b.shape == (weight.shape[0], R)
        assert b.abs().max() > 0, f"{key}: the adapter did not train"
        torch.testing.assert_close(merged[key], weight + (ALPHA / R) * (b @ a), rtol=0, atol=1e-6)
    return merged


def test_zero3_lora_trains_the_adapter_only_and_exports_adapter_and_merged_model(workspace, zero3_run):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    root, _ = workspace
    rows = read_metrics(zero3_run)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert all(set(KEYS) <= set(r) for r in rows)
    assert all(r["grad_norm"] > 0 for r in rows)
    # the checkpoints hold the adapters only: no frozen base weight in the module state or the optimizer
    step_dir = zero3_run / "checkpoints" / f"step_{STEPS:08d}"
    for rank in (0, 1):
        states = torch.load(step_dir / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt", weights_only=False)
        assert states["module"] and all(".lora_" in key for key in states["module"])
        assert all(".lora_" in key for group in states["param_shapes"] for key in group)
    assert sum(f.stat().st_size for f in step_dir.iterdir()) < (root / "base" / "model.safetensors").stat().st_size / 2
    _check_merged_export(root, zero3_run)
    assert json.loads((zero3_run / "final" / "adapter" / "adapter_config.json").read_text())["r"] == R
    # every file of final/ (merged weights, config, tokenizer, adapter) has the default mode; safetensors
    # alone would leave the weights 0600 (tests/recipes/reliability/test_export_writer.py)
    from recipes.training.file_modes import default_file_mode

    modes = {p.relative_to(zero3_run): p.stat().st_mode & 0o777 for p in (zero3_run / "final").rglob("*") if p.is_file()}
    assert set(modes.values()) == {default_file_mode()}, modes
    # transformers loads the merged model; PEFT's adapter on the base computes the same logits
    merged = AutoModelForCausalLM.from_pretrained(str(zero3_run / "final"))
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(root / "base")),
                                        str(zero3_run / "final" / "adapter"))
    ids = torch.arange(3, 19).reshape(2, 8)
    with torch.no_grad():
        torch.testing.assert_close(adapted(input_ids=ids).logits, merged(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


def test_zero2_lora_logs_and_exports_what_zero3_does(workspace, zero3_run):
    root, recipe = workspace
    out = root / "zero2"
    run_in_ranks(recipe, out, "deepspeed.zero_stage=2", "train.save_every=0")
    for a, b in zip(read_metrics(zero3_run), read_metrics(out)):
        for key in ("loss", "ce", "term/smmd", "term/ntl_was", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-5), (a["step"], key)
    merged2, merged3 = _check_merged_export(root, out), _check_merged_export(root, zero3_run)
    for key, value in merged3.items():
        torch.testing.assert_close(merged2[key], value, rtol=1e-4, atol=1e-6)


def test_lora_resume_from_a_checkpoint_is_bit_exact(workspace, zero3_run):
    root, recipe = workspace
    out = root / "resumed"
    run_in_ranks(recipe, out, "train.steps=2", "train.export=false")  # stops at its step-2 checkpoint
    output = run_in_ranks(recipe, out, "train.export=false")
    assert "resumed tiny from step 2" in output
    for got, want in zip(read_metrics(out), read_metrics(zero3_run)):
        for key in KEYS:
            assert got[key] == want[key], (got["step"], key, got[key], want[key])
    assert len(read_metrics(out)) == STEPS


@pytest.mark.parametrize("override, message", [
    ("train.engine=megatron", "not supported with train.engine: megatron"),
    ("deepspeed.tp_size=2", "not supported with deepspeed.tp_size"),
    ("loss.head=chunked", "lm_head cannot take an adapter"),
    ("model.lora.r=0", "needs r >= 1"),
])
def test_lora_recipe_refusals(workspace, override, message):
    from recipes.config import load_recipe

    _, recipe = workspace
    extra = ["model.lora.target_modules=[q_proj, lm_head]"] if "chunked" in override else []
    with pytest.raises(ValueError, match=message):
        load_recipe(recipe, [override, *extra])


def test_validate_counts_lora_memory_for_70b_on_one_node():
    """Llama-3-70B on one node of 8 GPUs under ZeRO-3: a full fine-tune does not fit 80 GiB (~16 bytes per
    parameter / 8); LoRA r 16 on q, k, v, o does: the frozen bf16 base / 8 + its largest module gathered
    + the adapter's weights, fp32 gradients and optimizer states / 8 (recipes.engines.deepspeed.pure.costs.lora_memory_estimate)."""
    from pathlib import Path

    from recipes.validation import validate as V

    r70 = Path(__file__).resolve().parents[5] / "recipes" / "configs" / "scale" / "llama3-70b-4x8.yaml"
    one_node = ["cluster.nodes=1", "train.micro_batch_size=1", "train.grad_accum=8"]
    full = V.validate_recipe(r70, one_node, offline=True, seq_len=1024)
    lora = V.validate_recipe(r70, [*one_node, "model.lora={r: 16}"], offline=True, seq_len=1024)
    assert not full.ok and any("does not fit" in e for e in full.errors), full.render()
    assert lora.ok, lora.render()
    p, largest = lora.numbers["params"], lora.numbers["largest_layer_params"]
    h, kv, layers = 8192, 8 * 128, 80
    adapter = layers * 16 * ((h + h) + 2 * (h + kv) + (h + h))  # q, k, v, o
    assert lora.numbers["lora_params"] == adapter == 65_536_000
    assert lora.numbers["gpu_mem_bytes"] == int(p * 2 / 8 + largest * 2 + adapter * (2 + 4 + 12) / 8)
    assert lora.numbers["disk_bytes"] == int(adapter * 12 * 2 + adapter * 2)  # ZeRO-3: 12 B/param x keep_last 2 + adapter
