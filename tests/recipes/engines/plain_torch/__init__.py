"""A third engine, defined here in one folder to prove the contract: plain single-process torch (an HF model
from its config, torch AdamW, its state in one file, the export through the one export writer). Shipped
code names it nowhere; a process trains on it after one line, `recipes.engines.register(PlainTorchContract)`
(test_plain_torch.py)."""
