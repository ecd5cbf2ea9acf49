"""Recipes: YAML files read into typed dataclasses, with `key.sub=value` overrides from the command line.

Every section is a dataclass; loading is strict: an unknown key, a missing required key or a value of
the wrong type is an error that names its dotted path (`optim.lr: expected a number, got 'fast'`). The
numeric objective's own section is read once, by `numloss.ObjectiveConfig` (unknown terms and options;
its errors name `loss.objective.terms.<term>.<key>`): `recipe.loss.objective` is that typed config, and
the recipe's dump writes it back as it was written. The modules of `loss.plugins` (terms of the user's)
are imported just before (`recipes.plugins`), so every entry point that loads the recipe knows them.
Files and overrides are read by `recipes.recipe_yaml`: a key given twice, a tab or any other syntax
error is refused with file:line:column; `3e-4` is a number, and a quoted number ("3e-4", a weight "3")
is never taken for one.

    recipe = load_recipe("recipes/configs/demo.yaml", ["optim.lr=3e-4", "loss.objective.terms={smmd: {}}"])

A recipe may start from another: `base: ce.yaml` (relative to the file; a base may have its own base).
The file's sections are merged key by key over the base's, and each value replaces the base's whole
(`loss.objective: {terms: {smmd: {}}}` is the new objective, not a union of terms), as an override
`loss.objective=...` would. A run's identity is never inherited: `name` is the file's own (default: its
stem) and `train.out_dir` the file's own (default: `runs/<name>`), so two recipes sharing a base never
write into one directory.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from numloss import ObjectiveConfig
from numloss.losses.options import float32_problem
from numloss.objective import ObjectiveConfigError

from .engines import ENGINES, engine_contract
from .engines.deepspeed.contract import DeepSpeedSection
from .engines.megatron.contract import MegatronSection
from .plugins import import_plugins, registered_by
from .recipe_yaml import load_yaml


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


@dataclass
class Recipe:
    name: str = "recipe"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    deepspeed: DeepSpeedSection = field(default_factory=DeepSpeedSection)
    megatron: MegatronSection = field(default_factory=MegatronSection)
    train: TrainSection = field(default_factory=TrainSection)
    eval: EvalSection = field(default_factory=EvalSection)
    cluster: ClusterSection = field(default_factory=ClusterSection)

    def validate(self) -> None:
        """Cross-field checks; raises ValueError naming the key."""
        choices = {
            "model.dtype": (self.model.dtype, ("bfloat16", "float32")),
            "loss.numeric_policy": (self.loss.numeric_policy, ("digits", "integers", "float")),
            "loss.head": (self.loss.head, ("logits", "chunked")),
            "optim.schedule": (self.optim.schedule, ("cosine", "constant")),
            "eval.answer_format": (self.eval.answer_format, ("number", "time")),
            "data.verify": (self.data.verify, ("size", "full", "none")),
        }
        for key, (value, allowed) in choices.items():
            if value not in allowed:
                raise ValueError(f"{key}: {value!r} is not one of {list(allowed)}")
        engine = engine_contract(self)  # ValueError naming train.engine and the known engines
        for contract in ENGINES.values():  # every engine's section, whichever engine trains
            problems = contract.section_problems(getattr(self, contract.section))
            if problems:
                raise ValueError(problems[0])
        if (self.model.name_or_path is None) == (self.model.config is None):
            raise ValueError("model: give exactly one of model.name_or_path and model.config")
        if self.model.config is not None and not self.model.tokenizer:
            raise ValueError("model.tokenizer: required when the model is built from model.config")
        problems = engine.recipe_problems(self)  # what the chosen engine cannot train at all
        if problems:
            raise ValueError(problems[0])
        positive = {"train.steps": self.train.steps, "train.micro_batch_size": self.train.micro_batch_size,
                    "train.grad_accum": self.train.grad_accum, "loss.chunk_size": self.loss.chunk_size,
                    "train.keep_last": self.train.keep_last,
                    "cluster.nodes": self.cluster.nodes, "cluster.cpu_ranks_per_node": self.cluster.cpu_ranks_per_node}
        for key, value in positive.items():
            if value < 1:
                raise ValueError(f"{key}: must be >= 1, got {value}")
        aux = self.loss.router_aux_coeff
        if aux is not None and not (math.isfinite(aux) and aux >= 0 and float32_problem(aux) is None):
            raise ValueError(f"loss.router_aux_coeff: must be a finite float32 number >= 0 (0: off, null: the model's"
                             f" router_aux_loss_coef), got {aux}")
        if self.train.grad_diagnostics_every is not None and self.train.grad_diagnostics_every < 0:
            raise ValueError(f"train.grad_diagnostics_every: must be >= 0 (0: off), got {self.train.grad_diagnostics_every}")
        if self.train.dist_timeout_minutes <= 0:
            raise ValueError(f"train.dist_timeout_minutes: must be > 0, got {self.train.dist_timeout_minutes}")
        o = self.optim
        for key, value in {"optim.lr": o.lr, "optim.grad_clip": o.grad_clip, "optim.warmup_steps": o.warmup_steps,
                           "optim.weight_decay": o.weight_decay, "optim.eps": o.eps,
                           "optim.min_lr_ratio": o.min_lr_ratio}.items():
            if not math.isfinite(value):  # NaN passes every comparison; inf trains a NaN model
                raise ValueError(f"{key}: must be a finite number, got {value}")
            if value < 0:
                raise ValueError(f"{key}: must be >= 0, got {value}")
            # the optimizer's state and master weights are float32 under either model.dtype: a value finite
            # in float64 can be inf there (optim.lr 1e40), or 0 (optim.eps 1e-50: a division by zero)
            in_float32 = float32_problem(value, strict_positive=key == "optim.eps")
            if in_float32:
                raise ValueError(f"{key}: {in_float32}")
        if o.eps <= 0:
            raise ValueError(f"optim.eps: must be > 0, got {o.eps}")
        if o.min_lr_ratio > 1:
            raise ValueError(f"optim.min_lr_ratio: must be in [0, 1], got {o.min_lr_ratio}")
        if len(o.betas) != 2 or not all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1
                                        for b in o.betas):
            raise ValueError(f"optim.betas: expected two numbers in [0, 1), got {o.betas}")
        if not math.isfinite(self.train.dist_timeout_minutes):
            raise ValueError(f"train.dist_timeout_minutes: must be finite, got {self.train.dist_timeout_minutes}")
        if not (math.isfinite(self.train.preempt_window_s) and self.train.preempt_window_s > 0):
            raise ValueError(f"train.preempt_window_s: must be a finite number > 0, got {self.train.preempt_window_s}")
        if not (math.isfinite(self.train.watchdog_s) and self.train.watchdog_s >= 0):
            raise ValueError(f"train.watchdog_s: must be a finite number >= 0 (0: off), got {self.train.watchdog_s}")
        if self.train.max_epochs is not None and not (math.isfinite(self.train.max_epochs)
                                                      and self.train.max_epochs > 0):
            raise ValueError(f"train.max_epochs: must be a finite number > 0, got {self.train.max_epochs}")
        if self.model.lora is not None:
            self._validate_lora()
        if not self.data.train:
            raise ValueError("data.train: required (a data_prep output directory)")

    def _validate_lora(self) -> None:
        lora = self.model.lora
        if self.model.vision:
            raise ValueError("model.lora is not supported with model.vision (not tested on vision towers)")
        if lora.r < 1 or lora.alpha <= 0 or not 0 <= lora.dropout < 1:
            raise ValueError(f"model.lora: needs r >= 1, alpha > 0 and 0 <= dropout < 1; got r={lora.r},"
                             f" alpha={lora.alpha}, dropout={lora.dropout}")
        targets = [lora.target_modules] if isinstance(lora.target_modules, str) else lora.target_modules
        if not targets or not all(isinstance(t, str) and t for t in targets):
            raise ValueError(f"model.lora.target_modules: module names or \"all-linear\", got {lora.target_modules!r}")
        if self.loss.head == "chunked" and "lm_head" in targets:
            raise ValueError("model.lora.target_modules: lm_head cannot take an adapter with loss.head: chunked"
                             " (the chunked head reads the head's weight directly)")

    def to_dict(self) -> dict:
        """The recipe as plain data (recipe.yaml, recipe.json, the run log), the objective as it was written."""
        data = dataclasses.asdict(self)
        data["loss"]["objective"] = self.loss.objective_mapping()
        return data


# ---- strict loading ----------------------------------------------------------------------------------


def _type_name(tp) -> str:
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp, path: str):
    """`value` checked against the annotation `tp` (dataclass, Optional, list, dict, int, float, str, bool)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(value, option, path)
            except ValueError as err:
                errors.append(str(err))
        raise ValueError(errors[0] if errors else f"{path}: unexpected value {value!r}")
    if tp is ObjectiveConfig:  # as written: LossConfig reads it with numloss's own strict reader
        return value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ValueError(f"{path or 'recipe'}: expected a mapping, got {type(value).__name__} {value!r}")
        return _build(tp, value, path)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ValueError(f"{path}: expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ValueError(f"{path}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        # never a string, even "3e-4": recipes.recipe_yaml reads 3e-4 as a number, so a string here was
        # quoted, as a weight "3" would be (numloss.ObjectiveConfig refuses that too)
        quoted = " (a quoted string: write the number without quotes)" if isinstance(value, str) else ""
        raise ValueError(f"{path}: expected a number, got {value!r}{quoted}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ValueError(f"{path}: expected a string, got {value!r}")
    if tp is list or origin is list:
        if isinstance(value, list):
            return list(value)
        raise ValueError(f"{path}: expected a list, got {value!r}")
    if tp is dict or origin is dict:
        if isinstance(value, dict):
            return dict(value)
        raise ValueError(f"{path}: expected a mapping, got {value!r}")
    raise TypeError(f"{path}: unsupported annotation {_type_name(tp)}")


def _build(cls, data: dict, path: str = ""):
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        where = f"{path}." if path else ""
        raise ValueError(f"unknown key {where}{unknown[0]} (known in {path or 'recipe'}: {sorted(names)})")
    kwargs = {}
    for key, value in data.items():
        kwargs[key] = _coerce(value, hints[key], f"{path}.{key}" if path else key)
    return cls(**kwargs)


def apply_override(data: dict, override: str) -> None:
    """`a.b.c=value` (value parsed as YAML) set into the nested dict `data`."""
    if "=" not in override:
        raise ValueError(f"override {override!r}: expected key.path=value")
    key, raw = override.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ValueError(f"override {override!r}: empty key component")
    node = data
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ValueError(f"override {override!r}: {part} is not a section")
        node = child
    node[parts[-1]] = load_yaml(raw, f"override {override!r}, its value")


def recipe_from_dict(data: dict, overrides: list[str] | tuple = ()) -> Recipe:
    data = copy.deepcopy(data or {})  # overrides write into nested sections: never into the caller's
    for override in overrides:
        apply_override(data, override)
    recipe = _build(Recipe, data)
    if not recipe.train.out_dir:
        recipe.train.out_dir = f"runs/{recipe.name}"
    recipe.validate()
    return recipe


def recipe_chain(path: str | Path) -> list[tuple[Path, dict]]:
    """A recipe file and its `base` chain, nearest first: [(file, its mapping without `base`), ...]."""
    chain: list[tuple[Path, dict]] = []
    path = Path(path)
    while True:
        if not path.is_file():
            where = f" (the base of {chain[-1][0]})" if chain else ""
            raise FileNotFoundError(f"recipe {path}{where} does not exist")
        seen = [p.resolve() for p, _ in chain]
        if path.resolve() in seen:
            raise ValueError(f"recipe {path}: base cycle {' -> '.join(map(str, seen + [path.resolve()]))}")
        with path.open() as f:
            data = load_yaml(f, str(path)) or {}
        if not isinstance(data, dict):
            raise ValueError(f"recipe {path}: expected a mapping at the top level, got {type(data).__name__}")
        base = data.pop("base", None)
        chain.append((path, data))
        if base is None:
            return chain
        if not isinstance(base, str):
            raise ValueError(f"recipe {path}: base: expected a file name, got {base!r}")
        path = path.parent / base


def read_recipe_file(path: str | Path) -> dict:
    """A recipe file as a plain dict with its `base` chain merged in (see the module docstring)."""
    chain = recipe_chain(path)
    merged: dict = {}
    for _, data in reversed(chain):  # the farthest base first, the file itself last
        for key, value in data.items():
            if isinstance(value, dict) and isinstance(merged.get(key), dict):
                merged[key] = {**merged[key], **value}  # a section: key by key
            else:
                merged[key] = value
    own_path, own = chain[0]  # a run's identity is the file's own, never its base's
    merged["name"] = own.get("name", own_path.stem)
    if isinstance(merged.get("train"), dict):
        own_out_dir = own["train"].get("out_dir") if isinstance(own.get("train"), dict) else None
        merged["train"] = {**merged["train"], "out_dir": own_out_dir or ""}
    return merged


def load_recipe(path: str | Path, overrides: list[str] | tuple = ()) -> Recipe:
    """Read (with its base), override, type-check and validate a recipe file."""
    data = read_recipe_file(path)
    try:
        return recipe_from_dict(data, overrides)
    except ValueError as err:
        raise ValueError(f"recipe {path}: {err}") from None


def dump_recipe(recipe: Recipe, path: str | Path) -> None:
    with Path(path).open("w") as f:
        yaml.safe_dump(recipe.to_dict(), f, sort_keys=False)
