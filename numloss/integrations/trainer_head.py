"""The Trainer integration's training loss inside the model's own forward, from its hidden states: no
full-vocabulary logits, as TRL's fused LM head has none.

`install(model)` wraps the forward of the Hugging Face model (under any PEFT wrapper; TRL patches its fused
head in the same place): `model(..., numeric_head=head)` runs the backbone only (`model.base_model`) and
returns `head(backbone_outputs, lm_head_weight, logit_transform)`, plus the MoE router's load-balancing loss
when `output_router_logits` is asked for. Without `numeric_head` the forward is the one it wrapped (TRL's
fused head under SFTTrainer, the model's own otherwise): evaluation and generation are unchanged.

`objective_head(...)` is the head a training micro-batch passes: `Objective.from_hidden`
(`numloss.chunked_head`) over the hidden states from the batch's first labelled position on, each
vocabulary chunk's logits at most HEAD_CHUNK_BYTES, with the model's logit scale / soft cap
(`numloss.logit_transform`, from its config); under SFTTrainer also TRL's entropy / top-1 sums over the
labelled positions (`trainer_loss.hidden_token_metric_sums`, chunks sized in bytes). Under autocast the
head runs in autocast's dtype, as the model's LM head would.

Why inside the forward: under DeepSpeed ZeRO-3 the lm_head weight is a shard except while gathered, and
the head reads it outside the lm_head module's forward. `register_zero3_head` registers it as an external
parameter of the module the engine calls (`deepspeed.zero.register_external_parameter`), so ZeRO-3 gathers
it for that module's forward and for its backward, once each per micro-batch; every rank runs the forward
once per micro-batch whatever its number of labelled tokens (a batch without one still runs the head), so
the gathers stay matched. Ranks may cut the vocabulary into different numbers of chunks: no collective runs
per chunk. (DeepSpeed 0.19's parameter getter also gathers a partitioned weight read inside a forward and
registers it on the innermost module running; the explicit registration names the module whose forward and
backward need it and does not depend on that getter.)
"""

from __future__ import annotations

import functools
import types
from typing import Callable

import torch

from ..logit_transform import LogitTransform
from ..normalization import LossCounts
from ..objective import Objective
from .trainer_loss import StepLoss, hidden_token_metric_sums

# Bytes of one vocabulary chunk's logits (fp32, plus the weight-dtype product and a soft cap's derivative)
# in the training head. TRL 1.16's fused head holds one [min(N, 4096), 32768] tile in the compute dtype
# (256 MiB fp32 at 2048 tokens) and an fp32 [V, H] gradient; this stays below it.
HEAD_CHUNK_BYTES = 128 << 20


def base_model_of(model):
    """The Hugging Face model under a PEFT wrapper (the model itself otherwise)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def head_problem(model) -> str | None:
    """Why the training loss cannot be computed from this model's hidden states (then the integration
    runs the model's own forward and its logits), or None."""
    base = base_model_of(model)
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    if head is None:
        return f"{type(base).__name__} has no output embeddings"
    weight = getattr(head, "weight", None)
    shape = getattr(weight, "ds_shape", None) or getattr(weight, "shape", ())  # ZeRO-3: a partition's full shape
    if not isinstance(weight, torch.nn.Parameter) or len(shape) != 2 or type(head) is not torch.nn.Linear:
        return f"its output embeddings are a {type(head).__name__}, not a plain Linear (an adapter on lm_head?)"
    if getattr(head, "bias", None) is not None:
        return "its lm_head has a bias"
    if getattr(base, "base_model", base) is base:
        return f"{type(base).__name__} has no backbone (base_model) to run without its head"
    return None


def head_chunk_size(weight: torch.Tensor, transform: LogitTransform | None) -> int:
    """The chunked head's `chunk_size` (tokens' worth of logits per vocabulary chunk) for HEAD_CHUNK_BYTES."""
    per_entry = 4 + (weight.element_size() if weight.dtype != torch.float32 else 0)
    if transform is not None and transform.softcap is not None:
        per_entry += 4  # the soft cap's derivative
    return max(1, HEAD_CHUNK_BYTES // (weight.shape[0] * per_entry))


def _router_aux_loss(model, backbone_outputs, attention_mask):
    """The MoE load-balancing loss the model's own forward computes from its router logits (Mixtral's
    function, which every transformers MoE family uses), unweighted."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    text = model.config.get_text_config()
    experts = getattr(model, "num_experts", None) or getattr(text, "num_experts", None) \
        or getattr(text, "num_local_experts", None)
    top_k = getattr(model, "num_experts_per_tok", None) or text.num_experts_per_tok
    return load_balancing_loss_func(backbone_outputs.router_logits, experts, top_k, attention_mask)


def install(model) -> None:
    """Wrap the forward of `model`'s Hugging Face model (see the module docstring). Idempotent."""
    base = base_model_of(model)
    if getattr(base, "_numloss_head", False):
        return
    wrapped = base.forward
    transform = LogitTransform.from_model_config(base.config)
    transform = None if transform.identity else transform

    @functools.wraps(type(base).forward)  # the model's signature: the Trainer and generate read it
    def forward(self, *args, numeric_head: Callable | None = None, **kwargs):
        if numeric_head is None:
            return wrapped(*args, **kwargs)
        kwargs["use_cache"] = False
        outputs = self.base_model(*args, **kwargs)
        result = numeric_head(outputs, self.get_output_embeddings().weight, transform)
        if kwargs.get("output_router_logits"):
            result["aux_loss"] = _router_aux_loss(self, outputs, kwargs.get("attention_mask"))
        return result

    base.forward = types.MethodType(forward, base)
    base._numloss_head = True


def register_zero3_head(module) -> None:
    """Under ZeRO-3 (a partitioned lm_head weight), make `module` (the outermost model, which the engine
    calls) gather the weight for its forward and backward. Nothing otherwise."""
    weight = base_model_of(module).get_output_embeddings().weight
    if hasattr(weight, "ds_id") and id(weight) not in getattr(module, "_external_params", {}):
        import deepspeed

        deepspeed.zero.register_external_parameter(module, weight)


def _compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """Autocast's dtype where autocast is on (the LM head's Linear would run in it), else the weight's."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return weight.dtype


def _full_weight(weight: torch.Tensor) -> torch.Tensor:
    """FSDP2 keeps parameters as DTensors sharded over the ranks while the hidden states are plain tensors:
    the whole weight (differentiable: its gradient goes back to the shards), as TRL's fused head does."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without the public DTensor module
        return weight
    return weight.full_tensor() if isinstance(weight, DTensor) else weight


def first_labelled(shifted: torch.Tensor, ignore_index: int) -> int:
    """The first position (column) where some row has a label; the last one when none has."""
    labelled = (shifted != ignore_index).any(0).nonzero()
    return int(labelled[0]) if labelled.numel() else shifted.shape[-1] - 1


def objective_head(step: StepLoss, shifted: torch.Tensor, counts: LossCounts | None) -> Callable:
    """The `numeric_head` of one training micro-batch: its share of the step's objective over `counts`
    from the hidden states at the positions of `shifted` (the batch's labels, shifted as HF shifts them),
    recorded in `step`; returns {"loss": ..., "token_metrics": [3] sums (with `step.token_metrics`)}.

    Positions before the first labelled one (the prompts of completion-only rows) are left out; after it
    every position is kept, so numbers and sequences stay as in the batch. Prompt-learning adapters
    prepend virtual positions to the hidden states: the labels align with the last ones."""
    objective: Objective = step.objective
    ignore = objective.config.ignore_index
    start = first_labelled(shifted, ignore)

    def head(backbone_outputs, weight: torch.Tensor, transform: LogitTransform | None) -> dict:
        hidden = backbone_outputs.last_hidden_state
        length = shifted.shape[-1]
        if hidden.shape[-2] < length:
            raise ValueError(f"numloss: the model's hidden states have {hidden.shape[-2]} positions, fewer than the"
                             f" batch's {length} labels")
        weight = _full_weight(weight)
        hidden = hidden[..., hidden.shape[-2] - length + start:, :].to(weight.device)
        targets = shifted[..., start:].to(weight.device)
        dtype = _compute_dtype(hidden, weight)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
        with torch.autocast(hidden.device.type, enabled=False):
            out = objective.from_hidden(hidden, weight, targets, counts=counts, logit_transform=transform,
                                        chunk_size=head_chunk_size(weight, transform))
            step.record(out)
            result = {"loss": out.loss}
            if step.token_metrics:
                result["token_metrics"] = hidden_token_metric_sums(hidden.detach(), weight.detach(), targets, ignore,
                                                                   transform)
        return result

    return head
