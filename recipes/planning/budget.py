"""What a recipe costs per GPU and per node beyond model states: activations, the head, host RAM at load
and export, checkpoints on disk, and the communication of one optimizer step against its compute.
Used by `recipes.planning.validate`; every number is an estimate from the model's shape, stated with its formula.

Shapes: L layers, hidden h, intermediate I, a attention heads of size d, k KV heads, vocabulary V,
tensor-parallel size t, T tokens per micro-batch (micro_batch_size x sequence length), e bytes per
activation (2 in bf16, 4 in fp32), P parameters.

- Activations saved for the backward of one decoder layer (per token, elements): the residual stream
  and its norm twice (4h), q/k/v before and after RoPE plus the attention output (3ad + 3kd, split t
  ways), the MLP's gate, up, activation and product (4I, split t ways); eager attention adds the
  a x seq attention probabilities twice. Without gradient checkpointing all L layers are held; with it,
  each layer's input (h per token) plus one layer recomputed during the backward.
- The head: logits path: [T, V/t] logits in the model dtype, their fp32 copy for the loss, its
  gradient and the logits' gradient, (2e + 8) bytes per entry; chunked (one vocabulary chunk at a time,
  numloss.chunked_head): a chunk of min(chunk_size, T/8) tokens' worth of the V/t logits, in the model
  dtype and fp32 (e + 4 bytes per entry; 4 in fp32), plus d hidden's fp32 accumulator and one product
  in the model dtype, T x h x (4 + e).
- Host RAM per node: at load, ZeRO 0-2 with AutoTP materialise the whole model per rank (ranks/node
  x P x e); otherwise each rank streams it a checkpoint shard (~5 GB) at a time (ZeRO-3 partitioned,
  ZeRO 0-2 at TP 1 straight onto its GPU, recipes.engines.deepspeed.model.load_placement). At export (recipes.engines.deepspeed.export) each rank holds
  its share, P x e / world + the largest module.
- Checkpoint on disk: DeepSpeed saves the model-dtype weights, fp32 master weights (bf16 only) and
  Adam's two fp32 moments: (e + 4 [bf16] + 8) x P bytes, times train.keep_last, plus the export (P x e).
  LoRA: the trainable adapter's A parameters in place of P (the frozen base is not saved), and the
  export is the adapter (A x e) plus, with `model.lora.export_merged`, the merged model (P x e).
- Communication per GPU per optimizer step (ring collectives move (n-1)/n of the data per rank; G
  micro-batches per step; gradients reduced in fp32 under bf16, see recipes.engines.deepspeed.config):
  ZeRO-3: every micro-batch gathers the parameters in the forward and again in the backward
  (P/t x e each) and reduce-scatters the gradients (P/t x 4); with hpZ (zero_hpz_partition_size) the
  backward gather stays inside the node. ZeRO 1-2: a gradient reduce-scatter per micro-batch and one
  parameter all-gather per step. ZeRO-0: one gradient all-reduce per step (2 x P/t x 4).
  TP: 4 all-reduces of [T, h] per layer per micro-batch, inside the node.
  Compute: 6 x P/t x T FLOPs per micro-batch (8 with gradient checkpointing: the forward runs twice).
  LoRA: gradients (and the ZeRO 0-2 parameter gather) are the adapter's only; ZeRO-3 still gathers the
  frozen base every micro-batch; compute 4 x P/t x T (no weight gradients of the base; 6 with checkpointing).
"""

from __future__ import annotations

from dataclasses import dataclass

GiB = 2**30


@dataclass
class Shape:
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def of(cls, config) -> "Shape":
        c = getattr(config, "text_config", None) or config
        heads = c.num_attention_heads
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
        return cls(c.num_hidden_layers, c.hidden_size, c.intermediate_size, heads,
                   getattr(c, "num_key_value_heads", None) or heads, head_dim, c.vocab_size)


def layer_activation_elements(s: Shape, tokens: int, tp: int, seq: int, eager: bool) -> float:
    """Elements one decoder layer saves for its backward (see the module docstring)."""
    per_token = 4 * s.hidden + (3 * s.heads * s.head_dim + 3 * s.kv_heads * s.head_dim + 4 * s.intermediate) / tp
    out = per_token * tokens
    if eager:
        out += 2 * (s.heads / tp) * seq * tokens  # attention probabilities and their dropout/softmax copy
    return out


def activation_bytes(s: Shape, tokens: int, tp: int, seq: int, act_bytes: int, checkpointing: bool,
                     eager: bool = False) -> float:
    layer = layer_activation_elements(s, tokens, tp, seq, eager) * act_bytes
    if not checkpointing:
        return s.layers * layer
    return s.layers * s.hidden * tokens * act_bytes + layer


def head_bytes(s: Shape, tokens: int, tp: int, act_bytes: int, chunked: bool, chunk_size: int) -> float:
    if chunked:
        chunk_tokens = min(chunk_size, -(-tokens // 8))  # at least 8 vocab chunks: numloss.chunked_head.MIN_CHUNKS
        per_entry = act_bytes + 4 if act_bytes < 4 else 4
        return chunk_tokens * (s.vocab / tp) * per_entry + tokens * s.hidden * (4 + act_bytes)
    return tokens * (s.vocab / tp) * (2 * act_bytes + 8)


def checkpoint_bytes(params: int, act_bytes: int) -> float:
    return params * (act_bytes + (4 if act_bytes == 2 else 0) + 8)


@dataclass
class Comm:
    inter_node_bytes: float  # per GPU per optimizer step, over the network
    intra_node_bytes: float  # per GPU per optimizer step, inside the node (NVLink)
    flops: float  # per GPU per optimizer step


def step_communication(params: int, s: Shape, *, zero_stage: int, tp: int, dp: int, nodes: int,
                       hpz: int, grad_accum: int, tokens: int, act_bytes: int,
                       checkpointing: bool, trainable: int | None = None) -> Comm:
    """Bytes each GPU sends per optimizer step (see the module docstring), split by where they go.
    `trainable`: the parameters that get gradients when fewer than `params` (LoRA's adapter)."""
    p = params / tp
    g = p if trainable is None else trainable / tp
    ring = (dp - 1) / dp if dp > 1 else 0.0
    grad_bytes = 4  # reduced in fp32 (recipes.engines.deepspeed.config)
    inter = intra = 0.0
    if zero_stage == 3:
        gather = p * act_bytes * ring
        forward, backward, reduce = gather, gather, g * grad_bytes * ring
        if hpz > 1:
            intra += grad_accum * backward
            backward = 0.0
        inter += grad_accum * (forward + backward + reduce)
    elif zero_stage in (1, 2):
        inter += grad_accum * g * grad_bytes * ring + g * act_bytes * ring
    else:
        inter += 2 * g * grad_bytes * ring
    if nodes == 1:  # one node: nothing crosses the network
        intra, inter = intra + inter, 0.0
    if tp > 1:
        intra += grad_accum * s.layers * 4 * tokens * s.hidden * act_bytes * 2 * (tp - 1) / tp
    flops = ((8 if checkpointing else 6) - (0 if trainable is None else 2)) * p * tokens * grad_accum
    return Comm(inter, intra, flops)


def _gib(n_bytes: float) -> str:
    return f"{n_bytes / GiB:.1f} GiB"


def report_budget(rep, recipe, cfg, total: int, largest: int, est: dict, *, gpu_mem_gb: float,
           seq_len: int | None, gpu_tflops: float, net_gbps: float, trainable: int | None = None) -> None:
    """recipes.planning.validate's part: GPU memory beyond model states (`est`, DeepSpeed's model-state estimate),
    host RAM, disk and communication, added to the report `rep` (recipes.planning.validate.Report), with an
    error naming the part that does not fit (exit status 1). `trainable`: LoRA's adapter parameters."""
    from recipes.engines.deepspeed.config import zero_comm_settings

    m, ds, tr, cl = recipe.model, recipe.deepspeed, recipe.train, recipe.cluster
    try:
        shape = Shape.of(cfg)
    except AttributeError as err:
        rep.warnings.append(f"memory: no layer shapes in the model config ({err}); activations not estimated")
        return
    seq = seq_len or recipe.data.seq_len or 1024
    seq_note = "" if (seq_len or recipe.data.seq_len) else " (data.seq_len unset: 1024 assumed, --seq-len)"
    tokens = tr.micro_batch_size * seq
    e = 2 if m.dtype == "bfloat16" else 4
    tp = ds.tp_size
    eager = m.attn_implementation == "eager"
    chunked = recipe.loss.head == "chunked"
    act = activation_bytes(shape, tokens, tp, seq, e, m.gradient_checkpointing, eager)
    other = activation_bytes(shape, tokens, tp, seq, e, not m.gradient_checkpointing, eager)
    head = head_bytes(shape, tokens, tp, e, chunked, recipe.loss.chunk_size)
    parts = {"model states": est["gpu_bytes"],
             f"activations (gradient checkpointing {'on' if m.gradient_checkpointing else 'off'})": act,
             f"head ({'chunked' if chunked else 'logits'})": head}
    gpu_total = sum(parts.values())
    rep.numbers.update(activation_bytes=int(act), head_bytes=int(head), gpu_total_bytes=int(gpu_total))
    rep.add("memory / GPU (all)", f"{_gib(gpu_total)} = " + " + ".join(f"{k} {_gib(v)}" for k, v in parts.items())
            + f"; {tr.micro_batch_size} x {seq} tokens per micro-batch{seq_note}; checkpointing "
            f"{'off' if m.gradient_checkpointing else 'on'} would make activations {_gib(other)}")
    if gpu_total > gpu_mem_gb * 2**30:
        big = max(parts, key=parts.get)
        rep.errors.append(f"memory: {_gib(gpu_total)} per GPU does not fit {gpu_mem_gb:g} GiB (--gpu-mem-gb): "
                          + ", ".join(f"{k} {_gib(v)}" for k, v in parts.items())
                          + f"; the largest part is {big}" + (
                              "; turn on model.gradient_checkpointing" if "off" in big else
                              "; use loss.head: chunked" if big.startswith("head (logits") and tp == 1 else
                              "; offload, more GPUs or a smaller micro-batch"))
    # host RAM per node, disk
    ranks = cl.ranks_per_node()
    world = cl.nodes * ranks
    model_bytes = total * e
    # ZeRO 0-2 under AutoTP: the whole model per rank (recipes.engines.deepspeed.model.load_placement); otherwise a
    # checkpoint shard (~5 GB) at a time per rank
    whole = ds.zero_stage < 3 and tp > 1
    load = ranks * model_bytes if whole else ranks * min(model_bytes, 5 * 2**30)
    merged = trainable is None or m.lora.export_merged  # a LoRA run without it exports the adapter alone
    export = ranks * (model_bytes / world + largest * e) if merged else trainable * e
    # DeepSpeed's CPU estimate is host memory the run keeps only under offload (optimizer/parameters on
    # the CPU); without it, it is printed, not added
    offload = ds.offload_optimizer or ds.offload_params
    host = max(load, export) + (est["cpu_bytes"] if offload else 0)
    rep.numbers.update(host_load_bytes=int(load), host_export_bytes=int(export))
    rep.add("host RAM / node", f"load {_gib(load)} ({'whole model per rank' if whole else 'a shard at a time'}),"
                               f" export {_gib(export)} (rank 0 alone {_gib(model_bytes / world + largest * e)}), "
                               f"DeepSpeed CPU estimate {_gib(est['cpu_bytes'])}"
                               f"{'' if offload else ' (counted under offload only)'}")
    if cl.host_mem_gb and host > cl.host_mem_gb * 2**30:
        rep.errors.append(f"cluster.host_mem_gb: {cl.host_mem_gb:g} GiB per node is less than the "
                          f"{_gib(host)} the run needs at {'load' if load >= export else 'export'}"
                          + (" (ZeRO 0-2 with AutoTP load the whole model on every rank: use ZeRO-3)" if whole
                             else ""))
    ckpt = checkpoint_bytes(total if trainable is None else trainable, e)
    exported = model_bytes if trainable is None else trainable * e + (model_bytes if m.lora.export_merged else 0)
    disk = ckpt * tr.keep_last + exported
    rep.numbers["disk_bytes"] = int(disk)
    rep.add("disk", f"{ckpt / 1e9:,.1f} GB per checkpoint x keep_last {tr.keep_last} + export "
                    f"{exported / 1e9:,.1f} GB = {disk / 1e9:,.1f} GB in train.out_dir")
    # communication vs compute
    dp = max(1, world // tp)
    hpz = zero_comm_settings(recipe, world).get("zero_hpz_partition_size", 1) if ds.zero_stage else 1
    comm = step_communication(total, shape, zero_stage=ds.zero_stage, tp=tp, dp=dp, nodes=cl.nodes, hpz=hpz,
                              grad_accum=tr.grad_accum, tokens=tokens, act_bytes=e,
                              checkpointing=m.gradient_checkpointing, trainable=trainable)
    t_comm = comm.inter_node_bytes / (net_gbps / 8 * 1e9)
    t_compute = comm.flops / (gpu_tflops * 1e12)
    ratio = t_comm / t_compute if t_compute else float("inf")
    rep.numbers.update(comm_inter_node_bytes=int(comm.inter_node_bytes), comm_intra_node_bytes=int(comm.intra_node_bytes),
                       step_flops=comm.flops, comm_compute_ratio=ratio)
    rep.add("comm / GPU / step", f"{comm.inter_node_bytes / 1e9:,.1f} GB over the network + "
                                 f"{comm.intra_node_bytes / 1e9:,.1f} GB inside the node"
                                 f"{f' (hpZ {hpz})' if hpz > 1 else ''}; compute {comm.flops / 1e12:,.0f} TFLOP; "
                                 f"at {net_gbps:g} Gb/s and {gpu_tflops:g} TFLOP/s: {t_comm:.1f} s network vs "
                                 f"{t_compute:.1f} s compute (ratio {ratio:.2f})")
    if ratio > 1:
        rep.warnings.append(f"communication: the network time per step ({t_comm:.1f} s) exceeds the compute "
                            f"({t_compute:.1f} s): larger micro-batches or grad_accum, TP inside the node, or hpZ")
