"""What the Trainer integration's tests share with their torchrun script: a tiny tokenizer, arithmetic
rows whose answers differ in length (so a per-micro-batch mean would weigh them differently), a tiny
random Llama, docs/library.md's snippets, and the objective of a whole batch computed at once."""

from __future__ import annotations

import re
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[3]
# 1, 6, 2, 2, 3 and 4 answer digits: micro-batches of these rows hold very different numeric counts
PROBLEMS = [("3+4=", "7"), ("123456+654321=", "777777"), ("12+30=", "42"), ("9*9=", "81"),
            ("500+499=", "999"), ("1000+2345=", "3345"), ("2+2=", "4"), ("40+2=", "42")]
SPEC = {"terms": {"smmd": {}, "ntl_was": {}}}  # docs/library.md's Trainer snippet's objective


def tokenizer(out_dir: str | Path):
    from recipes.experiments.tiny import train_tokenizer

    tok = train_tokenizer(["Calculate 0123456789 + - * / = . ( ) user assistant What is ?\n: "], out_dir, "digits")
    tok.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}assistant: {% endif %}")
    return tok


def rows(tok, n: int) -> list[dict]:
    """Prompt + answer + eos with labels -100 on the prompt (completion-only, as data_prep makes them)."""
    out = []
    for prompt, answer in PROBLEMS[:n]:
        p = tok(prompt, add_special_tokens=False)["input_ids"]
        a = tok(answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        out.append({"input_ids": p + a, "attention_mask": [1] * (len(p) + len(a)), "labels": [-100] * len(p) + a})
    return out


def chat_rows(n: int) -> list[dict]:
    """TRL's conversational prompt-completion rows (completion-only loss by default)."""
    return [{"prompt": [{"role": "user", "content": f"What is {q[:-1]}?"}],
             "completion": [{"role": "assistant", "content": a}]} for q, a in PROBLEMS[:n]]


def model(tok, seed: int = 0):
    from transformers import AutoConfig, AutoModelForCausalLM

    from recipes.experiments.tiny import tiny_llama_config

    config = dict(tiny_llama_config(len(tok)))
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(config.pop("model_type"), **config),
                                            dtype=torch.float32)


def trainer_snippets() -> list[str]:
    """The Python blocks of the "Use it in your trainer" section of docs/library.md (where the README sends a
    user with a trainer), in order."""
    text = (REPO / "docs" / "library.md").read_text()
    section = text.split("## Use it in your trainer", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


def whole_batch_objective(model, vocab, spec: dict, batch: dict) -> dict[str, float]:
    """The objective of the whole global batch in one forward, divided by its own counts, and the norm
    of its gradient (`grad_norm`): what the integration's step must log, computed without it."""
    from numloss import Objective
    from numloss import shift_labels

    model.zero_grad()
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    out = Objective(vocab, spec)(logits, shift_labels(batch["labels"]))
    out.loss.backward()
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None]))
    model.zero_grad()
    return {**out.log_dict(), "grad_norm": float(norm)}
