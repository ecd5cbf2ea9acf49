"""The vLLM backend of numloss's own evaluation: the same prompts, settings and text as the Hugging Face one.

`vllm` is imported inside the functions: this module imports without it, and `recipes.evaluation.evaluate`
picks this backend where `vllm` imports (`eval.backend: auto`) and the rows have no images.

- Prompts: each row's prompt token ids as they are (`{"prompt_token_ids": ...}`), the ids the model saw before
  its answer in training; nothing is re-tokenized, as in the HF backend.
- Sampling: greedy (temperature 0, n 1), `max_tokens` = max_new_tokens, `stop` = the task's stop strings (not
  kept in the text), `stop_token_ids` = the same ids the HF backend stops at, special tokens skipped in the
  text; the text is cut at the first stop string again (`generation.cut_at_stop`) so both backends return the
  same text for the same tokens.
- Placement: `tensor_parallel_size` from `recipes.evaluation.placement` (the export's size and the node's GPUs).
"""

from __future__ import annotations

from typing import Any, Sequence

from .generation import GenerationSettings, cut_at_stop


def vllm_importable() -> bool:
    """Whether `import vllm` works here (a broken install counts as absent: the HF backend is used)."""
    try:
        import vllm  # noqa: F401
    except Exception:
        return False
    return True


def sampling_params(settings: GenerationSettings) -> dict[str, Any]:
    """The keyword arguments of vllm.SamplingParams for `settings`."""
    return {"n": 1, "temperature": 0.0, "max_tokens": settings.max_new_tokens, "stop": list(settings.stop),
            "stop_token_ids": list(settings.stop_ids), "include_stop_str_in_output": False,
            "skip_special_tokens": True}


def prompts(rows: Sequence[dict]) -> list[dict[str, list[int]]]:
    """vLLM token prompts: each row's prompt ids."""
    return [{"prompt_token_ids": [int(t) for t in r["prompt_ids"]]} for r in rows]


def sampling_class():
    from vllm import SamplingParams

    return SamplingParams


def load_llm(model_dir: str, tensor_parallel_size: int = 1, dtype: str | None = None,
             trust_remote_code: bool = False):
    """A vllm.LLM on `tensor_parallel_size` GPUs (bf16 unless `dtype`)."""
    from vllm import LLM

    return LLM(model=model_dir, tensor_parallel_size=tensor_parallel_size, dtype=dtype or "bfloat16",
               trust_remote_code=trust_remote_code, seed=0)


def generate_vllm(llm, rows: Sequence[dict], settings: GenerationSettings) -> list[str]:
    """Greedy continuations of each row's prompt, in row order, cut at the first stop string."""
    params = sampling_class()(**sampling_params(settings))
    outputs = llm.generate(prompts(rows), params, use_tqdm=False)
    if len(outputs) != len(rows):
        raise RuntimeError(f"vLLM returned {len(outputs)} outputs for {len(rows)} prompts")
    return [cut_at_stop(o.outputs[0].text, settings.stop) for o in outputs]
