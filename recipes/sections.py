"""The recipe's engine-neutral sections, one dataclass each: `model` (and its `lora`), `data`, `loss`, `optim`,
`train` (and its `tracking`), `eval`, `cluster`. The engines' own sections (`deepspeed`, `megatron`) are their
contracts' (`recipes.engines`); `recipes.config` puts them all into one `Recipe` and loads it strictly. A
section checks what it can alone in `__post_init__`; what needs two sections is `Recipe.validate`'s.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field

from numloss import ObjectiveConfig
from numloss.objective import ObjectiveConfigError

from .plugins import import_plugins, registered_by


@dataclass
class LoraSection:
    """LoRA adapters through PEFT (`model.lora`): the base model is frozen in `model.dtype` and only the
    adapters (and their optimizer states) train. `alpha / r` scales the adapters' product B A."""

    r: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    # module names (PEFT matches a name or its last parts), or "all-linear": every linear layer but the head
    target_modules: list | str = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    export_merged: bool = False  # final/ also holds the merged model (base + alpha/r B A) transformers loads


@dataclass
class ModelConfig:
    """The backbone: a hub name or local path (`name_or_path`), or a config to build with random weights."""

    name_or_path: str | None = None
    config: dict | None = None  # e.g. {model_type: llama, hidden_size: 64, ...}: random init, for tests/demo
    tokenizer: str | None = None  # hub name or local dir; defaults to name_or_path
    dtype: str = "bfloat16"  # bfloat16 | float32 (fp16 is not offered: it needs loss scaling to train)
    attn_implementation: str | None = None  # None: flash_attention_2 when importable on a GPU, else sdpa
    vision: bool = False  # a vision-language model, loaded with AutoModelForImageTextToText + its processor
    gradient_checkpointing: bool = False
    trust_remote_code: bool = False
    lora: LoraSection | None = None  # None: the whole model trains


@dataclass
class DataConfig:
    """data_prep output directories (shards + manifest). Training reads nothing else."""

    train: str = ""
    eval: str | None = None
    seq_len: int | None = None  # pad every batch to this length (None: the longest row)
    # sort each global batch's rows by length before dealing them to ranks and micro-batches (each
    # micro-batch then pads to similar lengths); a step trains on the same rows, its loss and gradient
    # equal up to float summation order (data_prep.reader). false: the seeded order as it is
    length_bucketing: bool = True
    shuffle_window: int = 8192
    pad_to_multiple_of: int = 8
    # the shards' manifest records the tokenizer they were built with; a run refuses data whose tokenizer
    # is not the model's (same size, other ids: it trains silently on wrong tokens). true: a warning only
    allow_tokenizer_mismatch: bool = False
    # each shard against its manifest entry when the reader opens it: size (one stat), full (sha256 of
    # every byte), none
    verify: str = "size"


@dataclass
class LossConfig:
    """The numeric objective and the numeric vocabulary it is computed over."""

    # written as a mapping ({terms: {smmd: {}}, z_loss: 0}); numloss's typed config once the recipe loads
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    # modules that register terms of the user's (numloss.register_term), imported before the objective is
    # read (recipes.plugins): [mypkg.terms]; each must be importable wherever the recipe loads
    plugins: list = field(default_factory=list)
    numeric_policy: str = "digits"  # digits | integers | float
    numeric_max_value: int = 999
    space_variants: bool = False
    head: str = "logits"  # logits | chunked (hidden states, no full logits)
    chunk_size: int = 1024
    # mixture-of-experts models: the weight of the router's load-balancing loss (`router/aux`, added to the
    # objective and logged on its own; recipes/training/router_loss.py defines it). None: the HF config's
    # router_aux_loss_coef; 0: off. Dense models ignore it
    router_aux_coeff: float | None = None

    def __post_init__(self) -> None:
        import_plugins(self.plugins, "loss.plugins")  # the user's terms exist before the objective is read
        if not isinstance(self.objective, ObjectiveConfig):  # the recipe's mapping: read here, once
            written = copy.deepcopy(self.objective)
            try:
                self.objective = ObjectiveConfig.from_dict(self.objective, root="loss.objective")  # errors name loss.objective.*
            except TypeError as err:
                raise ValueError(f"loss.objective: {err}") from None
            except ObjectiveConfigError as err:
                if any(": unknown term;" in p for p in err.problems):
                    mine = registered_by(self.plugins)
                    raise ValueError(f"{err}; " + (f"loss.plugins registered {mine}" if mine else
                                     "name the module that registers it in loss.plugins")) from None
                raise
            self._written = (self.objective, written)

    def objective_mapping(self) -> dict:
        """The objective as the recipe's dump writes it (recipe.yaml, a checkpoint's recipe.json, the run
        log): the mapping it was read from, default weights not filled in, so dumps compare key by key
        with those written before. An objective set from code: `{}` for plain CE, else every field as
        numloss resolves it; either reads back as the same objective."""
        read = getattr(self, "_written", None)
        if read is not None and read[0] is self.objective:
            return copy.deepcopy(read[1])
        return {} if self.objective == ObjectiveConfig() else dataclasses.asdict(self.objective)


@dataclass
class OptimConfig:
    lr: float = 1e-5
    weight_decay: float = 0.0
    betas: list = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    warmup_steps: int = 0
    schedule: str = "cosine"  # cosine | constant
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0


TRACKERS = ("wandb", "mlflow")


@dataclass
class TrackingSection:
    """Experiment trackers beside metrics.jsonl (`recipes.training.tracking`): each gets the same rows."""

    backends: list = field(default_factory=list)  # any of TRACKERS
    project: str | None = None  # W&B project / MLflow experiment (None: the recipe's name)
    entity: str | None = None  # W&B entity (team or user; None: the account's default)
    group: str | None = None  # W&B group; an MLflow tag
    tags: list = field(default_factory=list)
    mode: str = "online"  # online | offline (W&B offline files in the run dir; MLflow's file store there)
    tracking_uri: str | None = None  # MLflow (None: MLFLOW_TRACKING_URI, else the run dir's file store)

    def __post_init__(self) -> None:
        unknown = [b for b in self.backends if b not in TRACKERS]
        if unknown:
            raise ValueError(f"train.tracking.backends: {unknown} not among {list(TRACKERS)}")
        if self.mode not in ("online", "offline"):
            raise ValueError(f"train.tracking.mode: {self.mode!r} is not online or offline")
        if not all(isinstance(t, str) and t for t in self.tags):
            raise ValueError(f"train.tracking.tags: expected a list of non-empty strings, got {self.tags!r}")


@dataclass
class TrainSection:
    engine: str = "deepspeed"  # a key of recipes.engines.ENGINES: deepspeed (HF model under DeepSpeed) | megatron
    steps: int = 100
    micro_batch_size: int = 1  # per rank
    grad_accum: int = 1
    global_batch_size: int | None = None  # if given: must equal micro * accum * data-parallel size
    seed: int = 0
    log_every: int = 1
    # per-term gradient diagnostics (numloss.diagnostics) on logged steps that are multiples of this
    # (and the last): None: every logged step; 0: off
    grad_diagnostics_every: int | None = None
    save_every: int = 0  # 0: only at the end
    # the most passes over data.train the steps may take (None: no limit; the count is reported, and a
    # warning when the data repeats); fewer rows than one global batch are always refused
    max_epochs: float | None = None
    keep_last: int = 2
    # a corrupt newest checkpoint (a file missing, truncated or changed since it was saved): true resumes
    # from the newest intact older one with a warning; false refuses and prints the command to do so
    resume_fallback: bool = True
    out_dir: str = ""  # "" -> runs/<name>
    export: bool = True  # a HF safetensors model (sharded, every rank writes its share) + tokenizer at the end
    # collectives' timeout: a slow checkpoint save or export at 70B runs past torch's 10-minute default
    dist_timeout_minutes: float = 60.0
    # SIGTERM/SIGUSR1 within this many seconds of the first are one preemption (SLURM signals every process
    # and torchrun forwards its own: two per rank, milliseconds apart); one after it stops the rank at once.
    # 600: past every automatic repeat (SLURM's KillWait, 30 s; its time-limit SIGTERM cluster.preempt_notice_s
    # = 300 s after the notice; torchrun's shutdown timeout in the templates, 300 s): a later one is a person
    preempt_window_s: float = 600.0
    # a rank silent this long, or stuck this long in a step while another waits on it, is named and the job
    # ends (exit 4) instead of waiting dist_timeout_minutes; the start, save and export are not judged as
    # stuck (recipes.reliability.watchdog). 600: torch's own collective timeout; 0: off
    watchdog_s: float = 600.0
    tensorboard: bool = True
    wandb_project: str | None = None  # shorthand for tracking: {backends: [wandb], project: ...}
    tracking: TrackingSection = field(default_factory=TrackingSection)
    progress: bool = True


# Stop strings of numloss's own evaluation by task (the data_prep source kind of the eval rows); a kind the
# recipe's eval.stop does not list uses these. The generated text is cut at the first one (the model's EOS
# and end-of-turn ids stop it too); one that occurs inside a row's gold target is refused before generating.
# GSM8K-style solutions: lm-eval's gsm8k stops ("Question:" opens the next few-shot turn); one-line answers: "\n".
EVAL_STOP = {
    "gsm8k": ["Question:", "</s>", "<|im_end|>"],
    "svamp": ["Question:", "</s>", "<|im_end|>"],
    "arithmetic": ["\n"],
    "deepmind_math": ["\n"],
    "clock": ["\n"],
    "clock_text": ["\n"],
    "chartqa": ["\n"],
}
EVAL_BACKENDS = ("auto", "vllm", "hf")


@dataclass
class EvalSection:
    data: str | None = None  # data_prep dir; defaults to data.eval
    batch_size: int = 16
    # None: from the eval rows, their longest target in tokens plus half of it, at least 16, so a chain of
    # thought as long as the data's fits (GSM8K solutions run to ~300 tokens)
    max_new_tokens: int | None = None
    answer_format: str = "number"  # number | time (H:MM, scored with the circular time gap)
    limit: int | None = None
    stop: dict[str, list[str]] = field(default_factory=lambda: copy.deepcopy(EVAL_STOP))  # by task, as EVAL_STOP
    backend: str = "auto"  # generation: auto (vLLM where it imports, else Hugging Face generate) | vllm | hf
    # training: every N optimizer steps the held-out rows (eval.data, else data.eval; at most eval.limit) give
    # eval/loss and the teacher-forced eval/exact_match, eval/mae (recipes.training.held_out); 0: never
    every: int = 0

    def __post_init__(self) -> None:
        if self.every < 0:
            raise ValueError(f"eval.every: must be >= 0 (0: no evaluation during training), got {self.every}")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(f"eval.max_new_tokens: must be >= 1 (null: from the eval data), got {self.max_new_tokens}")
        if self.batch_size < 1:
            raise ValueError(f"eval.batch_size: must be >= 1, got {self.batch_size}")
        if self.backend not in EVAL_BACKENDS:
            raise ValueError(f"eval.backend: {self.backend!r} is not one of {list(EVAL_BACKENDS)}")
        for task, stops in self.stop.items():
            if not isinstance(stops, list) or not all(isinstance(x, str) and x for x in stops):
                raise ValueError(f"eval.stop.{task}: expected a list of non-empty strings, got {stops!r}")

    def stop_for(self, task: str) -> list[str]:
        """The stop strings of a task: the recipe's, else EVAL_STOP's, else none (EOS only)."""
        return list(self.stop.get(task, EVAL_STOP.get(task, [])))


@dataclass
class ClusterSection:
    """Where the recipe is meant to run: used by `recipes.validate` and the launchers."""

    nodes: int = 1
    gpus_per_node: int = 0  # 0: CPU
    cpu_ranks_per_node: int = 1  # processes per node when gpus_per_node is 0
    cpus_per_worker: int = 1
    container: str | None = None
    partition: str | None = None
    time_limit: str = "24:00:00"
    # seconds before the time limit at which SLURM signals the batch script (`--signal=B:USR1@N`): the run
    # saves and stops (exit 75) and the job requeues itself; 0: no signal, no requeue
    preempt_notice_s: int = 300
    host_mem_gb: float = 0.0  # host RAM per node for recipes.validate's check (0: unknown, not checked)
    mem: str = "0"  # sbatch --mem per node (SLURM syntax, e.g. 480G); "0": all of each node's memory
    hf_home: str | None = None  # HF_HOME on shared storage for the job (models, tokenizers); mounted
    hf_offline: bool = True  # HF_HUB_OFFLINE=1: compute nodes read HF_HOME only, never the hub
    nccl_debug: str = "WARN"  # NCCL_DEBUG for the job (INFO when debugging a hang)
    nccl_socket_ifname: str | None = None  # NCCL_SOCKET_IFNAME, e.g. "ib0" or "^lo,docker"; None: NCCL picks
    # the hardware recipes.planning.step_model assumes (None: validate's flags / defaults: an H100 SXM,
    # 989 TFLOP/s peak, 80 GiB, GEMM rates by shape from recipes.planning.gemm_rates, one 400 Gb/s NIC per
    # GPU, 2880 Gb/s NVLink per GPU). gpu: H100, H200 or A100 (its rate table, peak and memory);
    # gpu_tflops: the GEMM rate at the largest shapes, the table scaled to it
    gpu: str | None = None
    gpu_tflops: float | None = None
    gpu_peak_tflops: float | None = None
    nic_gbps: float | None = None
    nics_per_node: int | None = None
    nvlink_gbps: float | None = None
    gpu_mem_gb: float | None = None

    def ranks_per_node(self) -> int:
        """Training processes per node: one per GPU, or `cpu_ranks_per_node` on CPU."""
        return self.gpus_per_node or self.cpu_ranks_per_node
