"""Experiments built on the recipes: `demo` (make demo), `study` (the loss studies), `regimes` (the regime
study on top of the SmolLM2 study), `backbone` (the packaged SmolLM2), `tiny` (tiny models, tokenizers and
data), `local` (torchrun on this machine). Floor 10: may import everything in recipes below it (launch
does not belong to it)."""
