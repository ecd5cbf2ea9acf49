"""Whether a build's tokenizer can be loaded from here, asked before the build starts its workers (each of
which would load it, and offline retry the hub for about a minute before failing with a traceback)."""

from __future__ import annotations

import os


def tokenizer_problem(name: str, revision: str | None = None) -> str | None:
    """Why the tokenizer `name` cannot be loaded from here, in one line naming `--tokenizer` (None: it can,
    as far as a cheap look tells): a path that is no directory, or a Hugging Face hub name neither in the
    local cache nor answered by the hub (one request, 10 s at most; transformers would retry for about a
    minute and fail inside every worker)."""
    local = "a local directory that holds the tokenizer (one saved with save_pretrained) works offline"
    if os.path.isdir(name):
        return None
    if os.path.exists(name) or name.startswith((".", "/", "~")) or name.count("/") > 1:
        return f"--tokenizer {name}: no such directory ({local})"
    try:
        from huggingface_hub import HfApi, try_to_load_from_cache
    except ImportError:
        return None  # transformers' own loader says what is missing
    for file in ("tokenizer_config.json", "tokenizer.json"):
        if isinstance(try_to_load_from_cache(name, file, revision=revision), str):
            return None  # in the cache: loads offline
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        return f"--tokenizer {name}: not in the Hugging Face cache and HF_HUB_OFFLINE is set ({local})"
    try:
        HfApi().model_info(name, revision=revision, timeout=10)
    except Exception as err:  # noqa: BLE001  (no network, a typo, a gated repo: each said in the line)
        said = " ".join(str(err).split())[:160]
        return f"--tokenizer {name}: the Hugging Face hub cannot be reached or has no such repo ({type(err).__name__}: {said}); {local}"
    return None
