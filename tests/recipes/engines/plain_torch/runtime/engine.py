"""The plain torch engine at run time: the HF model built from `model.config`, wrapped with the objective
(numloss.adapters.hf.NumericCausalLM), torch AdamW, the recipe's LR schedule, one process."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from numloss import NumericVocab, Objective
from numloss.adapters.hf import NumericCausalLM
from recipes.inputs.tokenizer import load_tokenizer
from recipes.reliability.export_writer import HFFiles, write_export, write_shard
from recipes.training.parallel import DataParallel, step_counts
from recipes.training.runtime import setup_distributed
from recipes.training.schedule import apply_recipe_schedule, lr_lambda

from ..pure.contract import NAME

STATE = "plain_torch.pt"


class PlainTorchEngine:
    name = NAME
    join_process_group = staticmethod(setup_distributed)
    processor = None

    def __init__(self, recipe, runtime, dirs):
        from transformers import AutoConfig, AutoModelForCausalLM

        config = dict(recipe.model.config)
        self.recipe, self.runtime = recipe, runtime
        self.model = AutoModelForCausalLM.from_config(AutoConfig.for_model(config.pop("model_type"), **config),
                                                      dtype=getattr(torch, recipe.model.dtype))
        self.tokenizer, _ = load_tokenizer(recipe)
        loss = recipe.loss
        vocab = NumericVocab.from_tokenizer(self.tokenizer, policy=loss.numeric_policy, max_value=loss.numeric_max_value,
                                            space_variants=loss.space_variants, vocab_size=self.model.config.vocab_size)
        self.wrapper = NumericCausalLM(self.model, Objective(vocab, recipe.loss.objective),
                                       chunked=recipe.loss.head == "chunked", chunk_size=recipe.loss.chunk_size)
        o = recipe.optim
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=o.lr, betas=tuple(o.betas), eps=o.eps,
                                           weight_decay=o.weight_decay)
        self.optimizer_name = "torch"
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(recipe))
        self.dp = DataParallel(0, 1, None)
        self.layout = {"engine": NAME, "data_parallel": 1}
        self.batch_options = {"attn_implementation": self.model.config._attn_implementation,
                              "dtype": getattr(torch, recipe.model.dtype), "max_length": recipe.data.seq_len,
                              "pad_to_multiple_of": recipe.data.pad_to_multiple_of, "processor": None}
        self._norm = None

    def train_step(self, window: list[dict], diagnostics: bool = False) -> dict[str, float]:
        """Each micro-batch's loss is its share of the step's (the step's counts): their gradients add up to
        the step's."""
        self.model.train()
        counts = step_counts(self.wrapper.counts, window, self.dp)
        sums: dict[str, float] = {}
        for inputs in window:
            result = self.wrapper(**inputs, loss_counts=counts, diagnostics=diagnostics)
            result.loss.backward()
            for key, value in result.log_dict().items():
                sums[key] = sums.get(key, 0.0) + value
        clip = self.recipe.optim.grad_clip or math.inf
        self._norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip))
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return sums

    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def grad_norm(self) -> float | None:
        return self._norm

    def save_state(self, directory: Path, step: int) -> None:
        torch.save({"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                    "scheduler": self.scheduler.state_dict(), "step": step}, Path(directory) / STATE)

    def load_state(self, directory: Path) -> None:
        state = torch.load(Path(directory) / STATE, weights_only=True)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        apply_recipe_schedule(self.scheduler, self.recipe)

    def export(self, path: Path, record=None) -> None:
        tensors = {k: v.detach().to("cpu").clone().contiguous() for k, v in self.model.state_dict().items()}
        files = HFFiles(config=self.model.config, generation_config=self.model.generation_config, tokenizer=self.tokenizer)
        write_export(path, lambda staging: [write_shard(staging, "model.safetensors", tensors)], files, record)

    def close(self) -> None:
        self.model = self.wrapper = self.optimizer = self.scheduler = None
