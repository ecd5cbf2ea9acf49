"""A recipe's backbone as a megatron-core GPTModel: model-parallel set-up, seeding, the layer spec, and the
HF config / weights converted for this rank's layout (`convert.py`).

Every function here is called by every rank; `initialize_model_parallel` and building a model with tied
embeddings at PP > 1 are collectives (megatron all-reduces the tied weight between the first and last
stage at build time).
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from recipes.config import Recipe
from recipes.training.runtime import clear_method_caches

from . import cpu_shim, moe
from .convert import (
    SafetensorsReader,
    gpt_model_kwargs,
    hf_to_megatron,
    rope_inv_freq,
    stage_ends,
    tp_split_dim,
    transformer_config_from_hf,
)
from ..pure.kernels import LOCAL_SPEC, KernelPlan, plan_kernels
from ..pure.layout import DIMS_KEYS, parallel_dims
from ..pure.support import hf_config_for


def initialize_model_parallel(recipe: Recipe) -> None:
    """Split the default process group into megatron's TP / PP / DP groups (TP fastest, then DP, then PP:
    `MegatronSection`'s order) and seed the model-parallel RNGs (`seed_model_parallel`).

    Parallel contract: a collective over the default group, which must be initialised (gloo on CPU,
    NCCL on GPUs); data-parallel size = world / (tp x pp). Expert parallelism (`megatron.ep_size`) is
    folded into data parallelism as megatron-core defines it: its expert grid is tp x ep x (expert-DP) x
    pp with the experts' TP size the model's, so ep must divide the data-parallel size; each group of ep
    consecutive DP ranks splits every MoE layer's experts. Applies the CPU shim first when there is no
    CUDA."""
    from megatron.core import parallel_state

    if not dist.is_initialized():
        raise RuntimeError("initialize_model_parallel: torch.distributed is not initialised")
    m = recipe.megatron
    parallel_dims(m, dist.get_world_size()).check(DIMS_KEYS)  # tp x pp divides the world, ep the data parallel
    if m.virtual_pp_size is not None and (m.pp_size < 2 or m.virtual_pp_size < 2):
        raise ValueError(f"megatron.virtual_pp_size {m.virtual_pp_size}: interleaving needs pp_size >= 2 and "
                         f"virtual_pp_size >= 2 (pp_size is {m.pp_size}); leave it null otherwise")
    if m.sequence_parallel and m.tp_size == 1:
        raise ValueError("megatron.sequence_parallel: needs megatron.tp_size > 1")
    cpu_shim.apply()
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=m.tp_size,
                                             pipeline_model_parallel_size=m.pp_size,
                                             virtual_pipeline_model_parallel_size=m.virtual_pp_size,
                                             expert_model_parallel_size=m.ep_size,
                                             expert_tensor_parallel_size=m.tp_size,
                                             context_parallel_size=m.cp_size)
    seed_model_parallel(recipe.train.seed)


def seed_model_parallel(seed: int) -> None:
    """Megatron-LM's seeding: Python, NumPy and torch get `seed + 100 x pp_rank` (stages initialise
    different layers differently), and megatron's RNG tracker gets its data-parallel state (same on
    every TP rank) and its tensor-parallel state (different per TP rank: dropout inside TP regions).
    On CPU the tracker's "CUDA" generator is the CPU one (cpu_shim). Call after
    `initialize_model_parallel`'s group set-up; every rank calls it."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    cpu_shim.apply()
    stage_seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(stage_seed)
    np.random.seed(stage_seed % 2**32)
    torch.manual_seed(stage_seed)
    model_parallel_cuda_manual_seed(stage_seed)


class RMSNorm(torch.nn.Module):
    """RMSNorm computed as HF Llama does (fp32 statistics, cast back, then the weight), usable with
    sequence parallelism: its weight is marked `sequence_parallel` when the config is, so megatron's
    `finalize_model_grads` all-reduces its gradient over TP (each TP rank saw only its slice of the
    sequence). megatron's own torch fallback (`WrappedTorchNorm`) refuses SP; apex's needs CUDA."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **unused):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        self.weight.sequence_parallel = bool(config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def layer_spec(config, pp_rank: int, vp_stage: int | None = None, plan: KernelPlan | None = None):
    """This chunk's decoder block spec for `plan.spec` (`kernels.py`): megatron's Transformer Engine spec
    (its norms fused into linear_qkv / linear_fc1, `TENorm` as the final norm and, with `qk_layernorm`, as
    the q / k norms), else its local spec with `RMSNorm` (above) as every norm, including the final one and
    the q / k norms, and `plan.core_attention` as its attention when given."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_local_spec,
    )
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    plan = plan if plan is not None else KernelPlan(spec=LOCAL_SPEC, fusions={}, ddp={}, packing="mask")
    if plan.te:
        return get_gpt_decoder_block_spec(config, use_transformer_engine=True, normalization="RMSNorm",
                                          vp_stage=vp_stage, pp_rank=pp_rank)
    # MoE (`config.num_moe_experts`): megatron's MoELayer with a SequentialMLP of local-linear experts
    local = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False,
                                     normalization="RMSNorm", qk_layernorm=config.qk_layernorm)
    attention = local.submodules.self_attention
    if plan.core_attention is not None:
        attention = dataclasses.replace(attention, submodules=dataclasses.replace(
            attention.submodules, core_attention=plan.core_attention))
    if config.qk_layernorm:
        # the local spec puts torch.nn.RMSNorm there (megatron's WrappedTorchNorm), which asserts that
        # sequence parallelism is off and keeps an fp32 weight whatever params_dtype; ours computes as HF's
        # Qwen3RMSNorm (fp32 statistics, rounded, then the weight)
        attention = dataclasses.replace(attention, submodules=dataclasses.replace(
            attention.submodules, q_layernorm=RMSNorm, k_layernorm=RMSNorm))
    sub = dataclasses.replace(local.submodules, input_layernorm=RMSNorm, pre_mlp_layernorm=RMSNorm,
                              self_attention=attention)
    layer = dataclasses.replace(local, submodules=sub)
    n = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    return TransformerBlockSubmodules(layer_specs=[layer] * n, layer_norm=RMSNorm)


def local_checkpoint_dir(name_or_path: str) -> Path:
    """A local directory with the checkpoint's safetensors: the path itself, or the hub snapshot in the
    HF cache (config and safetensors only; offline jobs read HF_HOME)."""
    path = Path(name_or_path)
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(name_or_path, allow_patterns=["*.json", "*.safetensors"]))


def load_hf_weights(model, reader, hf_config, *, tp_rank: int, tp_size: int, pp_rank: int, pp_size: int,
                    vp_stage: int | None = None, te: bool = False, ep_rank: int = 0) -> dict:
    """Write this rank's converted HF weights (`hf_to_megatron`) into a built GPTModel chunk, both tied
    copies included. No communication. Raises if any parameter is left unloaded or any converted tensor
    has no home. Returns the converted state dict (for checks)."""
    state = hf_to_megatron(reader, model.config, hf_config, tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank,
                           pp_size=pp_size, vp_stage=vp_stage, te_names=te, ep_rank=ep_rank)
    result = model.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
    if missing or result.unexpected_keys:
        raise RuntimeError(f"HF -> Megatron (TP rank {tp_rank}, PP rank {pp_rank}, chunk {vp_stage}): missing "
                           f"{missing}, unexpected {result.unexpected_keys}")
    return state


def generation_config_for(recipe: Recipe, hf_config):
    """The backbone's generation defaults, as transformers gives a loaded model them: the checkpoint's
    `generation_config.json` (an Instruct model's end-of-turn token ids, its sampling defaults), else the
    ones derived from its config. The export writes it back (`export.export_hf`)."""
    from transformers import GenerationConfig

    if recipe.model.name_or_path is not None:
        try:
            # (no trust_remote_code: GenerationConfig keeps unknown keyword arguments as settings)
            return GenerationConfig.from_pretrained(recipe.model.name_or_path)
        except OSError:  # no generation_config.json in the checkpoint: transformers derives one too
            pass
    return GenerationConfig.from_model_config(hf_config)


def build_gpt_model(recipe: Recipe, pre_process: bool, post_process: bool, vp_stage: int | None = None,
                    plan: KernelPlan | None = None, read_hf_weights: bool = True):
    """This rank's GPTModel chunk for the recipe's backbone (megatron's model-provider signature).

    Logits stay vocab-parallel (`parallel_output=True`: `[s, b, V'/tp]`, V' the padded vocabulary).
    The layer spec and fused kernels are `plan`'s (default: `kernels.plan_kernels(recipe.megatron)`).
    From `model.name_or_path` (an HF dir or hub name) the HF weights are read, only this rank's share,
    and converted for its (TP rank, PP rank, chunk), unless `read_hf_weights` is False: then the weights
    are left uninitialised for a checkpoint to fill (a resume, `megatron.load_converted`), and no byte of
    the HF weights is read (only its config.json and generation_config.json). From `model.config` the
    weights are megatron's random init. dtype: `model.dtype`; activation recomputation:
    `megatron.recompute`. RoPE frequencies are the HF model's (`rope.rope_inv_freq`, its scaling included).
    Attached for later: `hf_config` and `generation_config` (the export writes them), `kernel_plan`.

    Parallel contract: `initialize_model_parallel(recipe)` first; every rank calls it (a collective when
    embeddings are tied and PP > 1). No weights cross ranks: each rank reads its own from disk."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    cpu_shim.apply()
    m, mg = recipe.model, recipe.megatron
    plan = plan if plan is not None else plan_kernels(mg, cuda=torch.cuda.is_available())
    hf_config = hf_config_for(recipe)
    tp_rank, tp_size = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size()
    pp_rank, pp_size = parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_world_size()
    if (tp_size, pp_size) != (mg.tp_size, mg.pp_size):
        raise ValueError(f"megatron's groups are TP {tp_size} x PP {pp_size}, the recipe asks for TP {mg.tp_size} x "
                         f"PP {mg.pp_size}: call initialize_model_parallel(recipe) first")
    config = transformer_config_from_hf(hf_config, tp_size=tp_size, pp_size=pp_size, virtual_pp_size=mg.virtual_pp_size,
                                        sequence_parallel=mg.sequence_parallel, dtype=getattr(torch, m.dtype),
                                        recompute=mg.recompute, perform_initialization=m.name_or_path is None,
                                        fusions=plan.fusions, ep_size=mg.ep_size,
                                        moe_token_dispatcher=mg.moe_token_dispatcher,
                                        router_aux_coeff=recipe.loss.router_aux_coeff)
    if (pre_process, post_process) != stage_ends(config, pp_rank, vp_stage):
        raise ValueError(f"pre_process/post_process {pre_process}/{post_process} do not match pipeline rank {pp_rank}"
                         f" chunk {vp_stage}: expected {stage_ends(config, pp_rank, vp_stage)}")
    if dist.get_backend() == "gloo":
        # gloo: megatron's batched p2p (`batch_isend_irecv`) delivered wrong activations to interleaved
        # 1F1B from the third micro-batch on (found by the engine's layout tests); unbatched p2p is right
        config.batch_p2p_comm = False
    if config.num_moe_experts:
        moe.patch_router_gemm()
    spec = layer_spec(config, pp_rank, vp_stage, plan)
    model = GPTModel(config, spec, pre_process=pre_process, post_process=post_process, parallel_output=True,
                     vp_stage=vp_stage, **gpt_model_kwargs(hf_config, tp_size))
    mark_tensor_parallel(model)
    set_rope_frequencies(model, hf_config)
    if m.name_or_path is not None and read_hf_weights:
        reader = SafetensorsReader(local_checkpoint_dir(m.name_or_path))
        load_hf_weights(model, reader, hf_config, tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size,
                        vp_stage=vp_stage, te=plan.te, ep_rank=parallel_state.get_expert_model_parallel_rank())
    model.hf_config = hf_config  # what export writes back as config.json
    model.generation_config = generation_config_for(recipe, hf_config)  # and as generation_config.json
    model.kernel_plan = plan
    return model


def build_model_chunks(recipe: Recipe, plan: KernelPlan | None = None, read_hf_weights: bool = True) -> list:
    """Every GPTModel chunk of this rank: one, or `megatron.virtual_pp_size` with interleaving (chunk v
    holds the v-th of its stage's layer groups), each with its own pre/post-process flags, all with one
    kernel plan. Same contract as `build_gpt_model`."""
    from megatron.core import parallel_state

    plan = plan if plan is not None else plan_kernels(recipe.megatron, cuda=torch.cuda.is_available())
    pp_rank, pp = parallel_state.get_pipeline_model_parallel_rank(), recipe.megatron.pp_size
    vp = recipe.megatron.virtual_pp_size
    stages = [None] if vp is None else list(range(vp))
    return [build_gpt_model(recipe, pp_rank == 0 and v in (None, 0), pp_rank == pp - 1 and v in (None, len(stages) - 1),
                            vp_stage=v, plan=plan, read_hf_weights=read_hf_weights) for v in stages]


def release_model_parallel(model_chunks: list) -> None:
    """Destroy megatron's model-parallel state and empty the caches that would keep its groups alive
    through `model_chunks` (`recipes.training.runtime.teardown` then frees the groups). Local; the
    default process group stays."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    # destroy_model_parallel misses some of its globals (the intra-partial data-parallel groups with
    # context parallelism, megatron-core 0.16): a group left there lives until interpreter exit.
    for name, value in list(vars(parallel_state).items()):
        if name.startswith("_") and isinstance(value, torch.distributed.ProcessGroup):
            setattr(parallel_state, name, None)
    # RotaryEmbedding.forward is an lru_cache on the class (megatron-core 0.16), keyed by the module:
    # it keeps the module, and the context-parallel group it holds, alive until exit.
    clear_method_caches({type(module) for chunk in model_chunks for module in chunk.modules()})


def mark_tensor_parallel(model) -> None:
    """Give every TP-split parameter megatron's `tensor_model_parallel` / `partition_dim` /
    `partition_stride` attributes (split dimension from `convert.tp_split_dim`). megatron-core 0.16.1 sets
    them on parallel layers' weights only inside its random init (`perform_initialization`), so a model
    built to be loaded would look TP-replicated to every grad norm, which would then count TP rank 0's
    shard only. Local, idempotent."""
    for name, p in model.named_parameters():
        dim = tp_split_dim(name)
        if dim is not None and not getattr(p, "tensor_model_parallel", False):
            p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, dim, 1


def set_rope_frequencies(model, hf_config) -> None:
    """Replace the RoPE inverse frequencies megatron computed with the HF model's (scaling included).
    Must run before the first forward (megatron caches the rotary table per sequence length)."""
    rotary = getattr(model, "rotary_pos_emb", None)
    if rotary is not None:
        rotary.inv_freq = rope_inv_freq(hf_config, model.config.kv_channels).to(rotary.inv_freq.device)
