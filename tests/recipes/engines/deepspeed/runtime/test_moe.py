"""Mixture-of-experts models on the DeepSpeed engine: router/aux and what a user gets.

Tiny random Qwen3-MoE (q/k norms, norm_topk_prob), Mixtral (softmax-then-top-k renormalised) and Qwen2-MoE
(a shared expert, top-k not renormalised, q/k/v biases), 4 experts, top-2, 2 layers, router_aux_loss_coef 0.3 (large, so that a wrong router term moves the loss far past 1e-5).

- one process: packed rows (sdpa's 4-D mask, segment 0 padding) give the router/aux of the same examples
  unpacked; the training module's router/aux equals a NumPy computation of the definition
  (tests/recipes/training/test_router_loss.py, where the formula itself is checked) on the router logits
  the HF model itself returns (`output_router_logits=True`), on the logits and the chunked head, and its
  gradient equals an independent torch rewrite's; the objective is
  the dense model's; the coefficient comes from the HF config when `loss.router_aux_coeff` is null;
  coefficient 0 gives the plain module; AutoTP and an MoE family whose loss is not defined are refused;
- two gloo processes (DP 2), the engine's step 1 against a single-process reference (the HF model on the
  whole global batch: objective with the step's counts, router/aux as the mean of the four micro-batches'
  NumPy values, the gradient norm of their sum): ZeRO-2 and ZeRO-3 at micro-batch 2 x accumulation 2, and
  ZeRO-2 at micro-batch 4 x accumulation 1 (the same objective, its own router/aux: the mean of two
  larger micro-batches' values); with router_aux_coeff 0 the loss is the dense objective. The ZeRO-2 and
  ZeRO-3 runs' exports hold transformers' checkpoint names (one tensor per expert) and reload with the
  logits of the engine's trained model.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.distributed import run_ranks
from tests.recipes.training.test_router_loss import numpy_router_aux

VOCAB = 300
COEF = 0.3
COMMON = {"vocab_size": VOCAB, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "max_position_embeddings": 64, "tie_word_embeddings": False,
          "num_experts_per_tok": 2, "router_aux_loss_coef": COEF}
FAMILIES = {
    "qwen3_moe": {**COMMON, "head_dim": 16, "intermediate_size": 96, "moe_intermediate_size": 32, "num_experts": 4,
                  "norm_topk_prob": True},
    "mixtral": {**COMMON, "intermediate_size": 32, "num_local_experts": 4, "sliding_window": None},
    # a shared expert beside the routed ones, top-k probabilities not renormalised, q/k/v biases
    "qwen2_moe": {**COMMON, "intermediate_size": 96, "moe_intermediate_size": 32, "num_experts": 4,
                  "shared_expert_intermediate_size": 48, "norm_topk_prob": False},
}


def torch_router_aux(layers, top_k: int, coeff: float, real=None) -> torch.Tensor:
    """A second, differentiable implementation (one-hot counts) for the gradient check."""
    total = 0.0
    for logits in layers:
        if real is not None:
            logits = logits[real.reshape(-1).bool()]
        probs = torch.softmax(logits.double(), dim=-1)
        tokens, experts = probs.shape
        mask = torch.nn.functional.one_hot(probs.topk(top_k, dim=-1).indices, experts).sum(dim=(0, 1))
        total = total + coeff * experts / (top_k * tokens**2) * (probs.sum(0) * mask.double()).sum()
    return total


def tiny(family: str, seed: int = 0, **changes):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.for_model(family, **{**FAMILIES[family], **changes})
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def digits_objective():
    from numloss import NumericVocab, Objective

    vocab = NumericVocab(list(range(10, 20)), [float(d) for d in range(10)], vocab_size=VOCAB)
    return Objective(vocab, {"terms": {"smmd": {}, "ntl_was": {}}})


def batch(seed: int = 1, rows: int = 3, seq: int = 12):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (rows, seq), generator=g)
    ids[:, 4:7] = torch.randint(10, 20, (rows, 3), generator=g)  # numbers
    labels = ids.clone()
    labels[:, :2] = -100
    mask = torch.ones_like(ids)
    mask[0, -3:] = 0  # right padding: its positions still go through the routers
    labels[0, -3:] = -100
    return ids, labels, mask


def recipe_with(**loss):
    from recipes.config import recipe_from_dict

    return recipe_from_dict({"name": "moe", "model": {"name_or_path": "unused"}, "data": {"train": "unused"},
                             "loss": loss, "train": {"out_dir": "unused"}})


# ---- the training module (one process) ------------------------------------------------------------------


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("head", ["logits", "chunked"])
def test_module_router_aux_equals_numpy_on_hf_router_logits(family, head):
    from numloss.adapters.hf import NumericCausalLM
    from recipes.engines.deepspeed.runtime.model import training_module

    model, objective = tiny(family), digits_objective()
    ids, labels, mask = batch()
    module = training_module(model, objective, recipe_with(head=head, chunk_size=128))
    assert type(module).__name__ == "MoeNumericCausalLM" and module.routing.coeff == COEF  # from the HF config
    out = module(ids, labels, mask)
    hf = model(input_ids=ids, attention_mask=mask, output_router_logits=True)
    assert len(hf.router_logits) == 2 and hf.router_logits[0].shape == (ids.numel(), 4)
    expected = numpy_router_aux([t.detach().numpy() for t in hf.router_logits], 2, COEF, mask.numpy())
    assert float(out.router_aux.detach()) == pytest.approx(expected, rel=1e-6)
    padding_counted = numpy_router_aux([t.detach().numpy() for t in hf.router_logits], 2, COEF)
    assert abs(padding_counted - expected) > 1e-4 * expected  # the padding test means something
    assert expected > 0.3  # at least coeff per layer x ~balanced; a dropped layer would be far off
    # the objective is untouched: the dense wrapper's loss on the same model
    dense = NumericCausalLM(model, objective, chunked=head == "chunked", chunk_size=128)(ids, labels, mask)
    assert float(out.loss.detach()) == pytest.approx(float(dense.loss.detach()), rel=1e-6)
    # the gradient of router/aux reaches every router, equal to an independent implementation's
    routers = [layer.mlp.gate.weight for layer in model.model.layers]
    grads = torch.autograd.grad(out.router_aux, routers)
    reference = torch.autograd.grad(torch_router_aux(list(hf.router_logits), 2, COEF, mask), routers)
    for got, want in zip(grads, reference):
        assert want.abs().max() > 0
        torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-8)


def test_packed_rows_give_the_router_aux_of_the_same_examples_unpacked():
    from recipes.engines.deepspeed.runtime.model import training_module
    from recipes.inputs.batches import model_inputs

    model = tiny("mixtral")
    module = training_module(model, digits_objective(), recipe_with())
    ids, labels, _ = batch(seed=3, rows=2, seq=7)
    # one row holding both examples (segments 1, 2), 4 positions of padding (segment 0) after them
    packed = {"input_ids": torch.cat([ids[0], ids[1], torch.zeros(4, dtype=torch.long)])[None],
              "labels": torch.cat([labels[0], labels[1], torch.full((4,), -100)])[None],
              "attention_mask": torch.cat([torch.ones(14, dtype=torch.long), torch.zeros(4, dtype=torch.long)])[None],
              "position_ids": torch.cat([torch.arange(7), torch.arange(7), torch.arange(4)])[None],
              "segment_ids": torch.cat([torch.full((7,), 1), torch.full((7,), 2), torch.zeros(4, dtype=torch.long)])[None]}
    inputs, _ = model_inputs(packed, attn_implementation="sdpa")
    assert inputs["attention_mask"].dim() == 4
    together = module(**inputs)
    apart = module(ids, labels, torch.ones_like(ids))
    assert float(together.router_aux.detach()) == pytest.approx(float(apart.router_aux.detach()), rel=1e-5)


def test_gradient_checkpointing_records_each_router_once():
    from recipes.engines.deepspeed.runtime.model import training_module

    model = tiny("qwen3_moe")
    ids, labels, mask = batch()
    module = training_module(model, digits_objective(), recipe_with(router_aux_coeff=0.7))
    assert module.routing.coeff == 0.7  # the recipe's coefficient over the config's
    plain = module(ids, labels, mask)
    model.gradient_checkpointing_enable()
    model.train()
    calls = []
    model.model.layers[0].mlp.gate.register_forward_hook(lambda *_: calls.append(1))
    out = module(ids, labels, mask)
    assert float(out.router_aux) == pytest.approx(float(plain.router_aux), rel=1e-6)
    (out.loss + out.router_aux).backward()  # the recomputed forward records nothing
    assert len(calls) == 2  # the router ran twice: in forward and in the recomputation
    assert module.router_logits.recorded is None
    assert model.model.layers[0].mlp.gate.weight.grad.abs().max() > 0


def test_what_a_moe_model_cannot_take_is_refused():
    from numloss.adapters.hf import NumericCausalLM
    from recipes.engines.deepspeed.runtime.model import training_module

    objective = digits_objective()
    off = training_module(tiny("mixtral"), objective, recipe_with(router_aux_coeff=0.0))
    assert type(off) is NumericCausalLM  # coefficient 0: the plain module, no router term at all
    recipe = recipe_with()
    recipe.deepspeed.tp_size = 2
    with pytest.raises(ValueError, match="deepspeed.tp_size: 2 on a mixture-of-experts model"):
        training_module(tiny("qwen3_moe"), objective, recipe)
    from transformers import AutoConfig, AutoModelForCausalLM

    olmoe = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "olmoe", vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2))
    with pytest.raises(ValueError, match=r"olmoe\) is a mixture-of-experts model whose load-balancing"):
        training_module(olmoe, objective, recipe_with())
    assert type(training_module(olmoe, objective, recipe_with(router_aux_coeff=0))) is NumericCausalLM


# ---- the engine on two gloo processes ------------------------------------------------------------------

PROBE = torch.tensor([[5, 17, 12, 40, 99, 3, 250, 18]])
# (name, zero stage, micro-batch, accumulation, router_aux_coeff)
RUNS = [("zero2", 2, 2, 2, None), ("zero3", 3, 2, 2, None), ("zero2_micro4", 2, 4, 1, None),
        ("zero2_off", 2, 2, 2, 0.0)]


def _engine_recipe(assets: dict, family: str, zero: int, micro: int, accum: int, coeff):
    from tests.recipes.engines.megatron import engine_helpers as H

    recipe = H.make_recipe({"tokenizer": assets["tokenizer"], "model": assets[family]}, micro=micro, accum=accum,
                           steps=1)
    recipe.train.engine, recipe.deepspeed.zero_stage = "deepspeed", zero
    recipe.loss.router_aux_coeff = coeff
    return recipe


def _engine_ranks(rank, world, assets, out):
    import torch.distributed as dist


    from recipes.engines.deepspeed.runtime.engine import DeepSpeedEngine
    from recipes.reliability.checkpoints import CheckpointDirs
    from tests.recipes.engines.megatron import engine_helpers as H

    runtime, out = H.gloo_rank_runtime(rank, world), Path(out)
    rows = {}
    for family in FAMILIES:
        for name, zero, micro, accum, coeff in RUNS:
            recipe = _engine_recipe(assets, family, zero, micro, accum, coeff)
            engine = DeepSpeedEngine(recipe, runtime, CheckpointDirs(out / f"{family}_{name}", 1, runtime))
            rows[f"{family}/{name}"] = H.run_steps(engine, assets, 1, 1)[0]
            if name in ("zero2", "zero3"):  # the trained model's logits (ZeRO-3: gathered in forward), its export
                engine.engine.module.eval()
                with torch.no_grad():
                    logits = engine.engine.module.model(input_ids=PROBE).logits
                if rank == 0:
                    torch.save(logits.clone(), out / f"{family}_{name}_logits.pt")
                engine.export(out / f"{family}_{name}_export")
            engine.close()
    if rank == 0:
        H.write(out / "rows.json", rows)
    dist.barrier()


def _reference(assets: dict, family: str, micro: int, accum: int, coeff) -> dict[str, float]:
    """Step 1 in one process: the HF model on the global batch (2 replicas x `accum` micro-batches)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from numloss import NumericVocab, Objective
    from numloss.adapters.hf import NumericCausalLM
    from tests.recipes.engines.megatron import engine_helpers as H

    recipe = _engine_recipe(assets, family, 2, micro, accum, coeff)
    model = AutoModelForCausalLM.from_pretrained(assets[family], dtype=torch.float32)
    vocab = NumericVocab.from_tokenizer(AutoTokenizer.from_pretrained(assets["tokenizer"]), policy="digits",
                                        max_value=recipe.loss.numeric_max_value,
                                        space_variants=recipe.loss.space_variants, vocab_size=VOCAB)
    wrapper = NumericCausalLM(model, Objective(vocab, recipe.loss.objective), chunked=False)
    rows = H.global_batch(1, assets["tokenizer"])
    whole = {k: torch.stack([row[k] for row in rows]) for k in rows[0]}
    out = wrapper(whole["input_ids"], whole["labels"], whole["attention_mask"])  # the step's objective
    micro_batches = [mb for r in range(2) for mb in H.replica_window(1, assets["tokenizer"], r, 2, micro)]
    assert len(micro_batches) == 2 * accum
    aux_values, aux_graph = [], 0.0
    for mb in micro_batches:
        logits = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"],
                       output_router_logits=True).router_logits
        weight, real = COEF if coeff is None else coeff, mb["attention_mask"]
        aux_values.append(numpy_router_aux([t.detach().numpy() for t in logits], 2, weight, real.numpy()))
        aux_graph = aux_graph + torch_router_aux(list(logits), 2, weight, real)
    aux = float(np.mean(aux_values))
    (out.loss + aux_graph / len(micro_batches)).backward()
    norm = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in model.parameters() if p.grad is not None))
    return {"loss": float(out.loss.detach()) + aux, "ce": float(out.ce.detach()), "router/aux": aux, "grad_norm": norm,
            **{f"term/{k}": float(v.detach()) for k, v in out.terms.items()}}


@pytest.fixture(scope="module")
def engine_runs(tmp_path_factory):
    from tests.recipes.engines.megatron import engine_helpers as H

    root = tmp_path_factory.mktemp("deepspeed_moe")
    tokenizer = H.digits_tokenizer(root)
    assets = {"tokenizer": str(root / "tokenizer")}
    for family in FAMILIES:
        tiny(family, pad_token_id=tokenizer.pad_token_id).save_pretrained(str(root / family))
        assets[family] = str(root / family)
    out = root / "out"
    out.mkdir()
    run_ranks(2, _engine_ranks, assets, str(out), timeout=500)

    return assets, H.read(out / "rows.json"), out


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_step_one_equals_the_single_process_reference(engine_runs, family):
    assets, rows, _ = engine_runs
    for name, _, micro, accum, coeff in RUNS:
        row, want = rows[f"{family}/{name}"], _reference(assets, family, micro, accum, coeff)
        if coeff == 0:
            assert "router/aux" not in row  # off: no router term, the dense objective
            want["loss"] -= want.pop("router/aux")
        else:
            assert want["router/aux"] > 0.01 * want["loss"]  # large enough that a wrong one shows at 1e-5
        for key, value in want.items():
            assert row[key] == pytest.approx(value, rel=1e-5, abs=1e-9), f"{family} {name} {key}: {row[key]} != {value}"
    # accumulation 2 x micro-batch 2 and one micro-batch of 4: the same objective, and router/aux each the
    # mean of its own micro-batches' values, which differ (the definition is per micro-batch)
    two, four = rows[f"{family}/zero2"], rows[f"{family}/zero2_micro4"]
    assert two["ce"] == pytest.approx(four["ce"], rel=1e-6)
    assert abs(two["router/aux"] - four["router/aux"]) > 1e-6 * two["router/aux"]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_export_is_the_checkpoint_format_and_reloads(engine_runs, family):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    assets, _, out = engine_runs
    keys = set()
    for file in (out / f"{family}_zero3_export").glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            keys |= set(f.keys())
    # transformers' own checkpoint names: one tensor per expert, as save_pretrained writes them
    expert = {"qwen3_moe": "model.layers.1.mlp.experts.3.down_proj.weight",
              "qwen2_moe": "model.layers.1.mlp.experts.3.down_proj.weight",
              "mixtral": "model.layers.1.block_sparse_moe.experts.3.w2.weight"}[family]
    assert expert in keys and not any("gate_up_proj" in k for k in keys)
    if family == "qwen2_moe":  # its shared expert and that expert's gate
        assert {"model.layers.1.mlp.shared_expert.down_proj.weight", "model.layers.1.mlp.shared_expert_gate.weight"} <= keys
    logits = {}
    for name in ("zero2", "zero3"):  # the export reloads with the engine's own model's logits
        model = AutoModelForCausalLM.from_pretrained(out / f"{family}_{name}_export", dtype=torch.float32).eval()
        with torch.no_grad():
            logits[name] = model(PROBE).logits
        torch.testing.assert_close(logits[name], torch.load(out / f"{family}_{name}_logits.pt"), rtol=1e-5, atol=1e-6)
    before = AutoModelForCausalLM.from_pretrained(assets[family], dtype=torch.float32).eval()
    with torch.no_grad():
        assert (before(PROBE).logits - logits["zero2"]).abs().max() > 1e-3  # the step changed the model
    # ZeRO-2 and ZeRO-3 trained the same step; Adam's first update (lr * g / |g|) turns gradients' rounding
    # differences on tiny gradients into ~lr-sized weight differences, hence a looser bound here
    torch.testing.assert_close(logits["zero3"], logits["zero2"], rtol=1e-3, atol=1e-4)
