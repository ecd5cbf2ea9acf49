"""Mixture-of-experts backbones on the Megatron engine: Qwen3-MoE (q / k norms, top-k renormalised or not)
and Mixtral, on tiny random checkpoints (4 experts, top-2, 2 layers; routers with random weights so that
every expert is used; norms random).

- in one process: HF -> Megatron -> HF bit for bit at TP 1, TP 2, PP 2, EP 2 and TP 2 x EP 2 (each rank
  holds its EP rank's experts only); refusals (Qwen2-MoE by name, dense layers mixed in, router jitter, an
  EP that does not divide the experts, TP without SP, EP on a dense model); the dispatcher choice;
- on 2 gloo processes, one spawn: logits equal HF's (fp32, 1e-5) at TP 1 (DP 2), TP 2, PP 2 and EP 2 for
  both families and for Qwen3-MoE without top-k renormalisation; one training step of the engine's
  `step.train_step` (CE over 4 one-row micro-batches, one with padding) at DP 2, TP 2 + SP, PP 2 and EP 2
  (DP 2) gives the loss (objective + router/aux), router/aux, the gradient norm and every gradient of an
  independent computation on the HF model: CE from its logits and router/aux from its router logits by
  the formula (`moe.py`), the mean over micro-batches of Σ_l coeff·E/(k·T²)·Σ_e P_e·c_e over real tokens;
  the EP 2 model's export loads in transformers with the Megatron model's logits.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.recipes.engines.megatron.helpers import VOCAB, run_ranks

if importlib.util.find_spec("megatron.core") is None:
    raise ImportError("tests/recipes/engines/megatron needs megatron-core (pip install -e '.[megatron]')")

COMMON = {"vocab_size": VOCAB, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "max_position_embeddings": 64, "tie_word_embeddings": False,
          "num_experts_per_tok": 2, "router_aux_loss_coef": 0.05}
QWEN3_MOE = {**COMMON, "intermediate_size": 96, "moe_intermediate_size": 32, "num_experts": 4, "head_dim": 32,
             "norm_topk_prob": True}
MIXTRAL = {**COMMON, "intermediate_size": 48, "num_local_experts": 4, "sliding_window": None}
FAMILIES = {"qwen3_moe": ("qwen3_moe", QWEN3_MOE), "mixtral": ("mixtral", MIXTRAL),
            "qwen3_moe_unnormalised": ("qwen3_moe", {**QWEN3_MOE, "norm_topk_prob": False})}
B, S = 4, 24


def save_moe(kind: str, config: dict, out: Path) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    if (out / "config.json").is_file():
        return out
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(kind, **config), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.randn_like(p) * 0.1 + 1.0)
            elif name.endswith("gate.weight"):  # the router: HF starts it at 0 (every expert tied)
                p.copy_(torch.randn_like(p) * 0.5)
    model.save_pretrained(str(out), max_shard_size="60KB")
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    return {name: str(save_moe(kind, config, root / name)) for name, (kind, config) in FAMILIES.items()}


def _config(name: str, **changes):
    from transformers import AutoConfig

    kind, config = FAMILIES[name]
    return AutoConfig.for_model(kind, **{**config, **changes})


# ---- conversion, refusals (one process) ------------------------------------------------------------------


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("tp,pp,ep", [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 1, 2)])
def test_round_trip_bit_exact(checkpoints, name, tp, pp, ep):
    from transformers import AutoConfig

    from recipes.engines.megatron.runtime import moe
    from recipes.engines.megatron.runtime.convert import (
        SafetensorsReader,
        global_layer_names,
        hf_to_megatron,
        layer_range,
        megatron_to_hf,
        transformer_config_from_hf,
    )

    path = checkpoints[name]
    hf_config, reader = AutoConfig.from_pretrained(path), SafetensorsReader(path)
    hf = {k: reader(k) for k in reader}
    config = transformer_config_from_hf(hf_config, tp_size=tp, pp_size=pp, ep_size=ep, sequence_parallel=tp > 1)
    assert config.num_moe_experts == 4 and config.moe_router_topk == 2 and config.moe_expert_capacity_factor is None
    assert config.moe_aux_loss_coeff == 0.05 and not config.moe_router_pre_softmax  # renormalised top-k
    for te in (False, True):
        gathered: dict[str, list] = {}
        for pp_rank in range(pp):
            offset = layer_range(config, pp_rank).start
            for ep_rank in range(ep):
                for tp_rank in range(tp):
                    reader.bytes_read = 0
                    state = hf_to_megatron(reader, config, hf_config, tp_rank=tp_rank, tp_size=tp, pp_rank=pp_rank,
                                           pp_size=pp, te_names=te, ep_rank=ep_rank)
                    local = sorted({int(k.split("local_experts.")[1].split(".")[0]) for k in state if "local_experts" in k})
                    assert local == list(range(4 // ep))
                    layer = "decoder.layers.0.mlp."
                    width = 32 if name == "qwen3_moe" else 48  # the experts' own width (gate and up rows)
                    assert state[layer + "experts.local_experts.0.linear_fc1.weight"].shape == (2 * width // tp, 64)
                    assert (layer + "router.weight") in state and ("decoder.layers.0.pre_mlp_layernorm.weight" in state)
                    state = moe.global_expert_names(state, ep_rank, 4 // ep)
                    for k, t in global_layer_names(state, offset).items():
                        if ep_rank > 0 and "local_experts" not in k:
                            continue  # the dense tensors: EP rank 0's copy (every EP rank holds the same)
                        gathered.setdefault(k, []).append(t)
        back = megatron_to_hf(gathered, config, hf_config)
        assert sorted(back) == sorted(hf), (te, set(back) ^ set(hf))
        for k, t in hf.items():
            assert torch.equal(back[k], t), (te, k)


@pytest.mark.parametrize("kind, changes, match", [
    ("qwen2_moe", {}, "shared expert"),
    ("qwen3_moe", {"decoder_sparse_step": 2}, "dense layers mixed"),
    ("qwen3_moe", {"mlp_only_layers": [0]}, "dense layers mixed"),
    ("mixtral", {"router_jitter_noise": 0.1}, "router_jitter_noise"),
])
def test_what_is_not_converted_is_refused(kind, changes, match):
    from transformers import AutoConfig

    from recipes.engines.megatron.runtime.convert import check_supported, transformer_config_from_hf

    base = {**dict(FAMILIES.get(kind, (kind, COMMON))[1]), **changes}
    hf_config = AutoConfig.for_model(kind, **base)
    with pytest.raises(NotImplementedError, match=match):
        check_supported(hf_config)
    with pytest.raises(NotImplementedError, match=match):
        transformer_config_from_hf(hf_config)


def test_layouts_the_model_cannot_take_are_refused():
    from transformers import AutoConfig

    from recipes.engines.megatron.runtime.convert import transformer_config_from_hf
    from tests.recipes.engines.megatron.helpers import QWEN3

    with pytest.raises(ValueError, match="ep_size 3 does not divide the model's 4 experts"):
        transformer_config_from_hf(_config("mixtral"), ep_size=3)
    with pytest.raises(ValueError, match="sequence_parallel: an MoE model at megatron.tp_size 2 needs it"):
        transformer_config_from_hf(_config("mixtral"), tp_size=2)
    with pytest.raises(ValueError, match="has no experts"):
        transformer_config_from_hf(AutoConfig.for_model("qwen3", **QWEN3), ep_size=2)
    unnormalised = transformer_config_from_hf(_config("qwen3_moe_unnormalised"))
    assert unnormalised.moe_router_pre_softmax  # softmax, then top-k of the probabilities as they are
    assert transformer_config_from_hf(_config("mixtral"), router_aux_coeff=0.0).moe_aux_loss_coeff == 0.0


def test_the_dispatcher_choice():
    from recipes.engines.megatron.runtime.moe import resolve_dispatcher

    assert resolve_dispatcher("auto", cuda=False) == "allgather"
    assert resolve_dispatcher("auto", cuda=True) == "alltoall"
    assert resolve_dispatcher("alltoall", cuda=True) == "alltoall"
    assert resolve_dispatcher("allgather", cuda=True) == "allgather"
    with pytest.raises(ValueError, match="alltoall: needs CUDA"):
        resolve_dispatcher("alltoall", cuda=False)
    with pytest.raises(ValueError, match="flex"):
        resolve_dispatcher("flex")


# ---- against HF on 2 processes ------------------------------------------------------------------------------


def _recipe(path, tp=1, pp=1, ep=1, sp=False):
    from recipes.config import Recipe
    from recipes.engines.megatron.pure.contract import MegatronSection
    from recipes.sections import ModelConfig

    return Recipe(model=ModelConfig(name_or_path=str(path), dtype="float32"),
                  megatron=MegatronSection(tp_size=tp, pp_size=pp, ep_size=ep, sequence_parallel=sp))


def _rows():
    """4 one-row micro-batches (unshifted labels, -100 at padding); the last row has 6 padding tokens."""
    g = torch.Generator().manual_seed(11)
    ids, labels = torch.randint(0, VOCAB, (B, S), generator=g), torch.randint(0, VOCAB, (B, S), generator=g)
    mask = torch.ones(B, S, dtype=torch.long)
    mask[-1, -6:] = 0
    labels[mask == 0] = -100
    ids[mask == 0] = 0
    return ids, labels, mask


def router_aux_reference(router_logits, real: torch.Tensor, coeff: float, top_k: int) -> torch.Tensor:
    """Σ_l coeff·E/(k·T²)·Σ_e P_e·c_e over the real tokens of one micro-batch, from HF's router logits
    (one `[tokens, E]` tensor per layer), written out from the definition."""
    total = 0.0
    for logits in router_logits:
        logits = logits[real.reshape(-1).bool()]
        probs = torch.softmax(logits.float(), dim=-1)
        chosen = torch.topk(probs, top_k, dim=-1).indices
        counts = torch.zeros(probs.shape[-1]).index_add_(0, chosen.reshape(-1), torch.ones(chosen.numel()))
        t, e = probs.shape
        total = total + coeff * e / (top_k * t * t) * (probs.sum(0) * counts).sum()
    return total


def _hf_step(hf, ids, labels, mask):
    """The reference: the mean CE over the step's labels plus the mean over micro-batches of router/aux,
    its value, router/aux, and the gradients."""
    hf.zero_grad()
    shifted = labels[:, 1:]
    n = int((shifted != -100).sum())
    ce, aux = 0.0, 0.0
    for i in range(B):
        out = hf(ids[i:i + 1], attention_mask=mask[i:i + 1], output_router_logits=True)
        ce = ce + torch.nn.functional.cross_entropy(out.logits[0, :-1], shifted[i], ignore_index=-100,
                                                    reduction="sum") / n
        aux = aux + router_aux_reference(out.router_logits, mask[i], hf.config.router_aux_loss_coef,
                                         hf.config.num_experts_per_tok) / B
    (ce + aux).backward()
    grads = checkpoint_names({k: p.grad.clone() for k, p in hf.named_parameters()}, hf.config)
    norm = float(torch.sqrt(sum(g.double().square().sum() for g in grads.values())))
    return float(ce + aux), float(aux), norm, grads


def checkpoint_names(tensors: dict, hf_config) -> dict:
    """The HF model's in-memory tensors (transformers 5: fused `mlp.experts.gate_up_proj` `[E, 2F, H]`,
    `down_proj` `[E, H, F]`, the router `mlp.gate.weight`) under the checkpoint's per-expert names."""
    from recipes.engines.megatron.runtime.moe import hf_moe_names

    out = {k: v for k, v in tensors.items() if ".mlp." not in k}
    for layer in range(hf_config.num_hidden_layers):
        router, experts = hf_moe_names(hf_config, layer)
        base = f"model.layers.{layer}.mlp."
        out[router] = tensors[base + "gate.weight"]
        for e, (gate, up, down) in enumerate(experts):
            out[gate], out[up] = tensors[base + "experts.gate_up_proj"][e].chunk(2)
            out[down] = tensors[base + "experts.down_proj"][e]
    return out


class _Capture:
    """The engine step's optimizer, minus the update: keeps every main gradient and the global norm."""

    def __init__(self, chunks):
        from megatron.core import parallel_state

        from recipes.engines.megatron.runtime import step

        self.chunks, self.params, self.names = chunks, step._params(chunks), step._param_names(chunks)
        self.group = parallel_state.get_model_parallel_group()
        self.expert_group = parallel_state.get_expert_tensor_model_pipeline_parallel_group()
        self.grads = {}

    def step(self):
        from recipes.engines.megatron.runtime.step import global_grad_norm

        self.grads = {n: p.main_grad.clone() for n, p in zip(self.names, self.params)}
        return global_grad_norm(self.params, self.group, [p.main_grad for p in self.params],
                                expert_group=self.expert_group, names=self.names)

    def zero_grad(self):
        for chunk in self.chunks:
            chunk.zero_grad_buffer()


def _train(recipe, hf, reference, where):
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from numloss import NumericVocab, Objective
    from recipes.engines.megatron.runtime import step
    from recipes.engines.megatron.runtime.convert import hf_to_megatron
    from recipes.engines.megatron.runtime.model import build_model_chunks, initialize_model_parallel
    from recipes.engines.megatron.runtime.moe import AuxLossScale, install_aux_loss

    initialize_model_parallel(recipe)
    chunks = build_model_chunks(recipe)
    aux = AuxLossScale()
    for chunk in chunks:
        chunk.config.calculate_per_token_loss = True
        assert install_aux_loss(chunk, aux) == len([m for m in chunk.modules() if type(m).__name__ == "TopKRouter"]) > 0
    ddp = [DistributedDataParallel(c.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), c,
                                   disable_bucketing=i > 0) for i, c in enumerate(chunks)]
    step.configure_schedule(chunks[0].config, ddp)
    objective = Objective(NumericVocab([3, 4, 5], [0, 1, 2], vocab_size=chunks[0].vocab_size), {"terms": {}})
    ids, labels, mask = _rows()
    dp, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    mine = range(dp_rank * B // dp, (dp_rank + 1) * B // dp)
    window = [{"input_ids": ids[i:i + 1], "labels": labels[i:i + 1], "attention_mask": mask[i:i + 1]} for i in mine]
    capture = _Capture(ddp)
    for m in ddp:
        m.train()
    out = step.train_step(ddp, capture, objective, window, sequence_parallel=recipe.megatron.sequence_parallel,
                          real_vocab_size=VOCAB, aux=aux)
    summed = torch.tensor([out["loss"], out[step.ROUTER_AUX]], dtype=torch.float64)
    dist.all_reduce(summed, group=parallel_state.get_data_parallel_group())
    loss, router_aux, norm, grads = reference
    assert float(summed[1]) == pytest.approx(router_aux, rel=1e-5), where
    assert float(summed[0]) == pytest.approx(loss, rel=1e-5), where
    assert out["grad_norm"] == pytest.approx(norm, rel=1e-5), where
    tp_rank, pp_rank = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank()
    expected = hf_to_megatron(grads.__getitem__, chunks[0].config, hf.config, tp_rank=tp_rank,
                              tp_size=recipe.megatron.tp_size, pp_rank=pp_rank, pp_size=recipe.megatron.pp_size,
                              ep_rank=parallel_state.get_expert_model_parallel_rank())
    assert sorted(expected) == sorted(n.removeprefix("module.") for n in capture.grads), where
    for name, grad in capture.grads.items():
        torch.testing.assert_close(grad, expected[name.removeprefix("module.")], rtol=1e-4, atol=1e-6,
                                   msg=lambda m, n=name: f"{where} grad {n}: {m}")
    return ddp


def _against_hf(rank, world, paths, out):
    from megatron.core import parallel_state

    from recipes.engines.megatron.runtime.export import export_hf
    from tests.recipes.engines.megatron.runtime.test_model import _batch, _check_logits, _gather_vocab, _hf

    ids, _ = _batch()
    for name, path in paths.items():
        hf = _hf(path)
        with torch.no_grad():
            reference = hf(ids).logits
        for layout in ({"tp": 1}, {"tp": 2, "sp": True}, {"pp": 2}, {"ep": 2}):  # MoE under TP needs SP
            _check_logits(_recipe(path, **layout), reference, f"rank {rank} {name} {layout}")
        if name == "qwen3_moe_unnormalised":
            continue
        hf.train()
        ref = _hf_step(hf, *_rows())
        for layout in ({"tp": 1}, {"tp": 2, "sp": True}, {"pp": 2}, {"ep": 2}):
            ddp = _train(_recipe(path, **layout), hf, ref, f"rank {rank} {name} {layout}")
            if layout == {"ep": 2}:  # the trained... (not updated: the capture step does not update) model's export
                model = ddp[0].module
                model.eval()
                with torch.no_grad():
                    logits = _gather_vocab(model(ids, torch.arange(S)[None].expand_as(ids), None))
                export_hf(ddp, Path(out) / name)
                if rank == 0:
                    torch.save(logits[..., :VOCAB].clone(), Path(out) / f"{name}.pt")
                dist.barrier()
            parallel_state.destroy_model_parallel()


@pytest.fixture(scope="module")
def spawned(checkpoints, tmp_path_factory):
    out = tmp_path_factory.mktemp("moe_out")
    run_ranks(2, _against_hf, checkpoints, str(out), timeout=400)
    return out


def test_logits_loss_router_aux_and_gradients_equal_hf(spawned):
    """Every check runs in the spawned ranks (an assertion there fails the run)."""
    assert (spawned / "mixtral.pt").is_file()


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_the_ep2_export_loads_in_transformers_with_the_megatron_logits(spawned, name):
    from transformers import AutoModelForCausalLM

    from tests.recipes.engines.megatron.runtime.test_model import _batch

    model = AutoModelForCausalLM.from_pretrained(spawned / name, dtype=torch.float32).eval()
    assert model.config.model_type == FAMILIES[name][0]
    ids, _ = _batch()
    with torch.no_grad():
        logits = model(ids).logits
    torch.testing.assert_close(logits, torch.load(spawned / f"{name}.pt"), rtol=1e-5, atol=1e-5)
