"""How a data_prep row with an image becomes the inputs of a vision-language model, for training and
for evaluation alike.

data_prep stores text-only token ids (prompt through the chat template, then the target) and the image
bytes beside them: the number of image tokens depends on the model's processor (a fixed count for
LLaVA, one per 28x28 patch group for Qwen2.5-VL), so it cannot be fixed at build time. Here, per row:

1. the prompt is the row's ids before its first label; it is decoded (special tokens kept) and the
   processor's image placeholder is put at the start of the user turn (`vision_prompt`);
2. the processor tokenizes that text and expands the placeholder to the image's patch tokens, and
   turns the images into its pixel tensors;
3. the row's target ids and labels are appended unchanged after the processor's prompt ids, so the
   tokens the loss sees (and their numeric positions) are exactly the shards' tokens.

Training (`targets=True`) pads on the right and masks the prompt and the padding with -100;
evaluation (`targets=False`) stops after the prompt and pads on the left for generation. Both call the
same function, so the prompt a model is evaluated on is token for token the one it was trained on.

Processor outputs that are per token (`PER_TOKEN_KEYS`: `token_type_ids`, `mm_token_type_ids`) are carried
along each row and filled with 0 on target and padding positions; the rest (pixel values, image grids
or sizes) are per image and passed through as the processor made them.
"""

from __future__ import annotations

import io
from typing import Any, Sequence

import torch

IGNORE_INDEX = -100
# Processor outputs that hold one value per prompt token (the rest are per image). Known by name: a
# shape test could take an image tensor for one when its leading sizes happen to equal [B, T].
PER_TOKEN_KEYS = frozenset({"token_type_ids", "mm_token_type_ids"})


def load_processor(source: str, trust_remote_code: bool = False):
    """The model's AutoProcessor (tokenizer + image processor) from a hub name or a local directory."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(source, trust_remote_code=trust_remote_code)
    if getattr(processor, "tokenizer", None) is None or getattr(processor, "image_processor", None) is None:
        raise ValueError(f"{source}: AutoProcessor gave {type(processor).__name__}, which has no tokenizer and "
                         "image processor; a vision recipe needs a vision-language model's processor")
    return processor


def vision_prompt(text: str, processor) -> str:
    """The decoded prompt with the processor's image placeholder in front of the user's text.

    Qwen2-VL-style processors expect "<|vision_start|><|image_pad|><|vision_end|>", others their
    `image_token`; it goes right after the first user-turn header when one is found
    ("<|im_start|>user\\n", "[INST]", "<|start_header_id|>user<|end_header_id|>\\n\\n"), else right after
    a leading BOS, else at the very start.
    """
    tok = getattr(processor, "tokenizer", processor)
    image_token = getattr(processor, "image_token", None) or getattr(tok, "image_token", None) or "<image>"
    vocab = tok.get_vocab() if hasattr(tok, "get_vocab") else {}
    if "<|vision_start|>" in vocab and "<|vision_end|>" in vocab and image_token == "<|image_pad|>":
        placeholder = "<|vision_start|><|image_pad|><|vision_end|>"
    else:
        placeholder = image_token
    for header in ("<|im_start|>user\n", "[INST]", "<|start_header_id|>user<|end_header_id|>\n\n"):
        at = text.find(header)
        if at >= 0:
            cut = at + len(header)
            return text[:cut] + placeholder + text[cut:]
    bos = getattr(tok, "bos_token", None)
    if bos and text.startswith(bos):
        return bos + placeholder + text[len(bos):]
    return placeholder + text


def decode_image(data: bytes, where: str = "image"):
    """PNG/JPEG bytes -> an RGB PIL image (a clear error naming `where` if they do not decode)."""
    from PIL import Image

    try:
        return Image.open(io.BytesIO(data)).convert("RGB")
    except Exception as e:  # PIL raises several types; say which row
        raise ValueError(f"{where}: the image bytes do not decode ({type(e).__name__}: {e})") from None


def split_row(input_ids: Sequence[int], labels: Sequence[int]) -> tuple[list[int], list[int], list[int]]:
    """(prompt ids, target ids, target labels) of one unpadded row: the prompt ends at the first label."""
    first = next((i for i, lab in enumerate(labels) if lab != IGNORE_INDEX), len(labels))
    return list(input_ids[:first]), list(input_ids[first:]), list(labels[first:])


def vision_inputs(processor, prompts: Sequence[Sequence[int]], images: Sequence[bytes | None],
                  targets: Sequence[tuple[Sequence[int], Sequence[int]]] | None = None,
                  pad_to_multiple_of: int = 1, max_length: int | None = None,
                  where: Sequence[str] | None = None) -> dict[str, Any]:
    """Model inputs for a batch of rows (see the module docstring).

    prompts: each row's prompt ids as data_prep wrote them; images: each row's image bytes (None: a
    text-only row, no placeholder); targets: each row's (target ids, target labels) for training, or
    None for generation. Returns input_ids, attention_mask (and labels with targets) of [B, T] plus
    the processor's image tensors. T is rounded up to `pad_to_multiple_of`; a row longer than
    `max_length` is an error naming it (`where[i]`, default "row i").
    """
    tok = processor.tokenizer
    n = len(prompts)
    if len(images) != n or (targets is not None and len(targets) != n):
        raise ValueError(f"{n} prompts, {len(images)} images, {len(targets) if targets else 0} targets")
    names = list(where) if where is not None else [f"row {i}" for i in range(n)]
    texts, pil = [], []
    for i, (ids, img) in enumerate(zip(prompts, images)):
        text = tok.decode(list(ids), skip_special_tokens=False)
        if img is not None:
            text = vision_prompt(text, processor)
            pil.append(decode_image(img, names[i]))
        texts.append(text)
    side = tok.padding_side
    tok.padding_side = "right"  # we re-pad below; right makes each row's prompt a prefix
    try:
        enc = processor(text=texts, images=pil or None, return_tensors="pt", padding=True,
                        add_special_tokens=False)  # the decoded text already has BOS / the template
    finally:
        tok.padding_side = side
    enc = dict(enc)
    prompt_ids, prompt_mask = enc.pop("input_ids"), enc.pop("attention_mask").bool()
    per_token = {k: v for k, v in enc.items() if k in PER_TOKEN_KEYS}
    per_image = {k: v for k, v in enc.items() if k not in per_token}

    rows = []
    for i in range(n):
        keep = prompt_mask[i]
        ids = prompt_ids[i][keep]
        extra = {k: v[i][keep] for k, v in per_token.items()}
        lab = torch.full_like(ids, IGNORE_INDEX)
        if targets is not None:
            t_ids = torch.as_tensor(list(targets[i][0]), dtype=ids.dtype)
            t_lab = torch.as_tensor(list(targets[i][1]), dtype=ids.dtype)
            if t_ids.shape != t_lab.shape:
                raise ValueError(f"{names[i]}: {len(t_ids)} target ids but {len(t_lab)} labels")
            ids, lab = torch.cat([ids, t_ids]), torch.cat([lab, t_lab])
            extra = {k: torch.cat([v, v.new_zeros((len(t_ids),) + v.shape[1:])]) for k, v in extra.items()}
        if max_length is not None and len(ids) > max_length:
            raise ValueError(f"{names[i]}: {len(ids)} tokens with the image expanded, more than "
                             f"data.seq_len={max_length}")
        rows.append((ids, lab, extra))

    width = max(len(ids) for ids, _, _ in rows)
    if max_length is not None and targets is not None:
        width = max_length
    width = -(-width // pad_to_multiple_of) * pad_to_multiple_of
    pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    out = {"input_ids": torch.full((n, width), pad, dtype=prompt_ids.dtype),
           "attention_mask": torch.zeros((n, width), dtype=torch.long)}
    if targets is not None:
        out["labels"] = torch.full((n, width), IGNORE_INDEX, dtype=prompt_ids.dtype)
    for k, v in per_token.items():
        out[k] = v.new_zeros((n, width) + v.shape[2:])
    for i, (ids, lab, extra) in enumerate(rows):
        span = slice(0, len(ids)) if targets is not None else slice(width - len(ids), width)
        out["input_ids"][i, span] = ids
        out["attention_mask"][i, span] = 1
        if targets is not None:
            out["labels"][i, span] = lab
        for k, v in extra.items():
            out[k][i, span] = v
    out.update(per_image)
    return out


def training_inputs(processor, batch: dict[str, Any], pad_to_multiple_of: int = 1,
                    max_length: int | None = None) -> dict[str, Any]:
    """A `ShardDataset` batch of image rows -> the model's training inputs (labels included).

    Every row must carry an image: under ZeRO-3 the vision tower's parameters are gathered by a
    collective, so a rank whose batch skipped the tower would leave the others waiting.
    """
    records = batch["record"].tolist()
    images = batch.get("images") or [None] * len(records)
    missing = [r for r, img in zip(records, images) if img is None]
    if missing:
        raise ValueError(f"records {missing[:8]} of a vision recipe have no image; every training row needs "
                         "one (ZeRO-3 gathers the vision tower collectively, so all ranks must run it)")
    prompts, targets = [], []
    for ids, lab, mask in zip(batch["input_ids"], batch["labels"], batch["attention_mask"]):
        n = int(mask.sum())
        prompt, t_ids, t_lab = split_row(ids[:n].tolist(), lab[:n].tolist())
        prompts.append(prompt)
        targets.append((t_ids, t_lab))
    return vision_inputs(processor, prompts, images, targets, pad_to_multiple_of=pad_to_multiple_of,
                         max_length=max_length, where=[f"record {r}" for r in records])
