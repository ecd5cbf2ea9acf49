"""The DeepSpeed engine: Hugging Face models under ZeRO 0-3, AutoTP and DeepSpeed-Ulysses.

`pure/` (floor 4: no torch or deepspeed at module level): `contract` (its section, refusals, adopted
settings, layout and checkpoint rules), `plan` (its memory and time plan), `costs` (its cost model),
`report` (validate's lines of its plan), `config` (the DeepSpeed config dict). `runtime/` (floor 7: torch
and deepspeed; may import up to recipes.reliability): `engine`, `distributed` (import and process group),
`model`, `moe`, `lora`, `optimizer`, `checkpoints`, `export`, `ulysses`."""
