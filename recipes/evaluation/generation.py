"""What numloss's own evaluation generates with, whatever the backend: the settings (stop strings, stop ids,
length), and the Hugging Face `generate` backend. The vLLM backend is `recipes.evaluation.vllm_generation`;
both return the text cut at the first stop string, so the same model outputs score the same.

- Stop strings: per task (the data_prep source kinds of the eval rows, `recipes.sections.EVAL_STOP` unless the
  recipe's `eval.stop` says otherwise). A stop string that occurs inside a row's gold target would cut a
  correct answer short: refused before generating (`check_stops`), naming the row.
- Stop ids: the tokenizer's and generation config's EOS plus every special token that ends a row's labels
  in the shards (a chat template's end-of-turn, e.g. "<|im_end|>"), so a chat model stops where it was
  trained to stop.
- Length: `max_new_tokens` None is the eval rows' longest target in tokens plus half of it, at least 16
  (`default_max_new_tokens`), so chain-of-thought data gets room for its solutions.
- Decoding: greedy. HF batches are left-padded, rows sorted by prompt length to waste little padding,
  results put back in row order.
"""

from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Sequence

from recipes.sections import EvalSection
from recipes.inputs.vision import load_processor, vision_inputs

IGNORE_INDEX = -100
MIN_NEW_TOKENS = 16


@dataclass(frozen=True)
class GenerationSettings:
    """How every backend generates: greedy, at most `max_new_tokens`, stopping at `stop_ids` (tokens) or
    `stop` (strings: the text is cut before the first one)."""

    max_new_tokens: int
    stop: tuple[str, ...] = ()
    stop_ids: tuple[int, ...] = ()
    batch_size: int = 16

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "stop": list(self.stop), "stop_ids": list(self.stop_ids), "decoding": "greedy"}


def task_kinds(manifest: dict) -> list[str]:
    """The data_prep source kinds of a build (its manifest's sources), in order, without repeats."""
    kinds: list[str] = []
    for source in manifest.get("sources", []):
        kind = source.get("kind") if isinstance(source, dict) else None
        if kind and kind not in kinds:
            kinds.append(kind)
    return kinds


def stop_strings(kinds: Sequence[str], eval_section=None) -> tuple[str, ...]:
    """The union of the tasks' stop strings (the recipe's `eval` section, else `recipes.sections.EVAL_STOP`)."""
    section = eval_section or EvalSection()
    out: list[str] = []
    for kind in kinds:
        out += [s for s in section.stop_for(kind) if s not in out]
    return tuple(out)


def target_ids(row: dict) -> list[int]:
    return [lab for lab in row["labels"] if lab != IGNORE_INDEX]


def default_max_new_tokens(rows: Sequence[dict]) -> int:
    """The longest target of the rows in tokens plus half of it, at least MIN_NEW_TOKENS."""
    longest = max((len(target_ids(r)) for r in rows), default=0)
    return max(MIN_NEW_TOKENS, longest + (longest + 1) // 2)


def check_stops(rows: Sequence[dict], stops: Sequence[str], tokenizer) -> None:
    """A stop string inside a gold target would cut a correct answer: ValueError naming the row and the string."""
    if not stops or tokenizer is None:
        return
    for r in rows:
        text = tokenizer.decode(target_ids(r), skip_special_tokens=True)
        for s in stops:
            if s in text:
                raise ValueError(f"stop string {s!r} occurs in the gold target of example {r['example_id']} "
                                 f"({text[:80]!r}): generation would stop inside a correct answer; set eval.stop "
                                 f"for this task without it")


def cut_at_stop(text: str, stops: Sequence[str]) -> str:
    """The text before the first stop string (the stop string itself is no part of the answer)."""
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=len(text))
    return text[:cut]


def stop_token_ids(generation_config, tokenizer, rows: Sequence[dict]) -> list[int]:
    """EOS ids of the tokenizer and the generation config (a model's, or None), plus each special token that
    ends a row's labels."""
    ids: set[int] = set()
    for source in (getattr(tokenizer, "eos_token_id", None), getattr(generation_config, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(int(x) for x in source)
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    for r in rows:
        last = target_ids(r)
        if last and last[-1] in special:
            ids.add(int(last[-1]))
    return sorted(ids)


def settings_for(rows: Sequence[dict], generation_config, tokenizer, kinds: Sequence[str], eval_section=None,
                 max_new_tokens: int | None = None, batch_size: int = 16,
                 stop: Sequence[str] | None = None) -> GenerationSettings:
    """The settings of an evaluation: `stop` None takes the tasks' stop strings; checked against the targets."""
    stops = tuple(stop) if stop is not None else stop_strings(kinds, eval_section)
    check_stops(rows, stops, tokenizer)
    return GenerationSettings(max_new_tokens=max_new_tokens or default_max_new_tokens(rows), stop=stops,
                              stop_ids=tuple(stop_token_ids(generation_config, tokenizer, rows)), batch_size=batch_size)


# ---- the Hugging Face backend --------------------------------------------------------------------------


def pick_device(device: str | None = None):
    import torch

    if device:
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def load_model(model_dir: str, vision: bool = False, device=None, dtype: str | None = None,
               device_map: str | None = None, trust_remote_code: bool = False):
    """(model, tokenizer, processor or None) in eval mode. dtype None: bf16 on a GPU, fp32 on the CPU."""
    import torch
    from transformers import AutoTokenizer

    device = pick_device(device)
    if dtype is None:
        torch_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    else:
        torch_dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}[dtype]
    kwargs: dict[str, Any] = {"dtype": torch_dtype, "trust_remote_code": trust_remote_code}
    if device_map:
        kwargs["device_map"] = device_map
    processor = None
    if vision:
        from transformers import AutoModelForImageTextToText

        processor = load_processor(model_dir, trust_remote_code=trust_remote_code)
        tokenizer = processor.tokenizer
        model = AutoModelForImageTextToText.from_pretrained(model_dir, **kwargs)
    else:
        from transformers import AutoModelForCausalLM

        tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
        model = AutoModelForCausalLM.from_pretrained(model_dir, **kwargs)
    if not device_map:
        model.to(device)
    model.eval()
    return model, tokenizer, processor


def _pad_id(tokenizer, stops: Sequence[int]) -> int:
    if getattr(tokenizer, "pad_token_id", None) is not None:
        return int(tokenizer.pad_token_id)
    return int(stops[0]) if stops else 0


def _stop_string_criteria(tokenizer, stop: Sequence[str]):
    """A stopping criterion that ends a row once its new text holds a stop string. transformers' own
    `stop_strings` rebuilds the vocabulary's strings and fails on some tokenizers (a word-level one without
    the letters it probes with); this one decodes each row's last tokens. A stop it misses costs time only:
    the text is cut at the first stop string after decoding anyway."""
    import torch
    from transformers import StoppingCriteria, StoppingCriteriaList

    window = max(len(s) for s in stop) + 8  # tokens: a token is at least one character, special ones aside

    class StopStrings(StoppingCriteria):
        def __init__(self):
            self.start = None

        def __call__(self, input_ids, scores, **kwargs):
            if self.start is None:  # the first call comes after the first new token
                self.start = input_ids.shape[1] - 1
            tails = tokenizer.batch_decode(input_ids[:, max(self.start, input_ids.shape[1] - window):],
                                           skip_special_tokens=True)
            return torch.tensor([any(s in t for s in stop) for t in tails], device=input_ids.device)

    return StoppingCriteriaList([StopStrings()])


def generate_texts(model, tokenizer, rows: Sequence[dict], batch_size: int = 16, max_new_tokens: int = 16,
                   processor=None, progress: bool = False, stop: Sequence[str] = (),
                   stop_ids: Sequence[int] | None = None) -> list[str]:
    """Greedy continuations of each row's prompt (left-padded batches), decoded without special tokens and
    cut at the first stop string. `stop_ids` None: `stop_token_ids`."""
    import torch

    stops = list(stop_ids) if stop_ids is not None else stop_token_ids(getattr(model, "generation_config", None),
                                                                            tokenizer, rows)
    pad = _pad_id(tokenizer, stops)
    device = next(model.parameters()).device
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]["prompt_ids"]))
    out: list[str | None] = [None] * len(rows)
    t0 = time.time()
    for b in range(0, len(order), batch_size):
        idx = order[b:b + batch_size]
        batch_rows = [rows[i] for i in idx]
        if processor is not None and any(r.get("image") for r in batch_rows):
            inputs = vision_inputs(processor, [r["prompt_ids"] for r in batch_rows],
                                   [r.get("image") for r in batch_rows],
                                   where=[f"example {r['example_id']}" for r in batch_rows])
            inputs = {k: v.to(device) if hasattr(v, "to") else v for k, v in inputs.items()}
        else:
            width = max(len(r["prompt_ids"]) for r in batch_rows)
            ids = torch.full((len(idx), width), pad, dtype=torch.long)
            mask = torch.zeros((len(idx), width), dtype=torch.long)
            for j, r in enumerate(batch_rows):
                n = len(r["prompt_ids"])
                if n:
                    ids[j, width - n:] = torch.tensor(r["prompt_ids"], dtype=torch.long)
                    mask[j, width - n:] = 1
            inputs = {"input_ids": ids.to(device), "attention_mask": mask.to(device)}
        extra = {"stopping_criteria": _stop_string_criteria(tokenizer, stop)} if stop else {}  # one per batch
        with torch.no_grad():
            gen = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, num_beams=1,
                                 eos_token_id=stops or None, pad_token_id=pad, temperature=None,
                                 top_p=None, top_k=None, **extra)
        new = gen[:, inputs["input_ids"].shape[1]:].tolist()
        for j, i in enumerate(idx):
            toks = new[j]
            for k, t in enumerate(toks):  # cut at the first stop token (the rest is padding)
                if t in stops:
                    toks = toks[:k]
                    break
            out[i] = cut_at_stop(tokenizer.decode(toks, skip_special_tokens=True), stop)
        if progress:
            done = min(b + batch_size, len(order))
            print(f"  {done}/{len(order)} rows, {time.time() - t0:.1f}s", file=sys.stderr, flush=True)
    return [o or "" for o in out]
