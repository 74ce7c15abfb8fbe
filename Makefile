# Every target installs what it needs first; `make demo` and `make test` work on a fresh clone.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# Quiet TensorFlow, keep tfds/keras/W&B caches inside the checkout.
export TF_CPP_MIN_LOG_LEVEL := 3
export TF_ENABLE_ONEDNN_OPTS := 0
export WANDB_SILENT := true
# Python writes a module's bytecode the first time a process imports it, even where the caller's
# environment sets PYTHONDONTWRITEBYTECODE: otherwise every process of the suite or a demo stage
# compiles TensorFlow's and JAX's modules again (about 6 s each; uv installs none).
unexport PYTHONDONTWRITEBYTECODE
comma := ,
# Tests and benchmarks run in this process tree: preload jemalloc for them too when it is there.
# Expanded where a recipe uses them (`=`, not `:=`): after `install` has put the library in the
# venv, so the first `make test` or `make demo` of a fresh clone preloads it too.
JEMALLOC = $(firstword $(wildcard $(VENV)/lib/libjemalloc.so.2 /usr/lib/x86_64-linux-gnu/libjemalloc.so.2))
WITH_JEMALLOC = $(if $(JEMALLOC),LD_PRELOAD=$(abspath $(JEMALLOC)) MALLOC_CONF=oversize_threshold:0$(comma)dirty_decay_ms:60000$(comma)muzzy_decay_ms:60000 VMOE_ALLOCATOR=jemalloc,)

.PHONY: install gpu browser demo test test-full test-cluster test-export test-install bench bench-gpu study-ensembles study-heads study-routers study-balance study-contrastive study-experts clean

# JAX's CUDA build, pinned with its NVIDIA libraries in constraints.txt: `make install GPU=auto`
# installs cuda13 for an NVIDIA driver of R580 or newer, cuda12 for R525+, and says which and why
# (without a GPU it says so and keeps the CPU install). GPU=cuda12 or GPU=cuda13 forces a build.
# Either way the install fails, saying why, where JAX then sees no GPU (runner/accelerator.py).
# Empty: the CPU build only.
GPU ?=
GPU_BUILDS := cuda12 cuda13
GPU_STAMPS := $(GPU_BUILDS:%=$(VENV)/.installed-%)

install: $(STAMP) $(if $(GPU),gpu)

$(STAMP): pyproject.toml constraints.txt
	@# A Python the pinned set has wheels for: python3, else the newest python3.X on PATH that
	@# runs, or PYTHON=... where it is given (install/python.py; one line says which, or why none).
	@python=$$(python3 install/python.py $(if $(filter file,$(origin PYTHON)),,'$(PYTHON)')) \
	  && echo "$$python -m venv $(VENV)" && "$$python" -m venv $(VENV)
	@# uv installs the pinned set in parallel, seconds instead of pip's minute (README's
	@# installation notes), and compiles the bytecode as pip does: a command run where the
	@# environment sets PYTHONDONTWRITEBYTECODE=1 (many containers and CI images) would otherwise
	@# compile TensorFlow's and JAX's sources again every time. pip where uv cannot be had.
	$(BIN)/pip install -q --disable-pip-version-check -c constraints.txt uv \
	  && $(BIN)/uv pip install -q --compile-bytecode --python $(BIN)/python -c constraints.txt \
	  -e '.[test,cluster]' \
	  || $(BIN)/pip install -q --disable-pip-version-check -c constraints.txt -e '.[test,cluster]'
	@# jemalloc makes CPU training 1.4-1.6x faster (docs/speed.md); optional, Debian/Ubuntu only.
	@cd $(VENV) && (apt-get download libjemalloc2 >/dev/null 2>&1 \
	  && dpkg -x libjemalloc2_*.deb jemalloc-pkg && cp jemalloc-pkg/usr/lib/*/libjemalloc.so.2 lib/ \
	  && echo "jemalloc: $(VENV)/lib/libjemalloc.so.2") \
	  || echo "jemalloc not available here: CPU training runs, but slower (see docs/speed.md)"; \
	  rm -rf jemalloc-pkg libjemalloc2_*.deb
	touch $(STAMP)

# The build GPU names, or the one the driver runs (GPU=auto): nothing where there is no GPU.
gpu: $(STAMP)
	@build=$$($(BIN)/python -m runner.accelerator build '$(GPU)') \
	  && if [ -n "$$build" ]; then $(MAKE) --no-print-directory $(VENV)/.installed-$$build; fi

$(GPU_STAMPS): $(VENV)/.installed-%: $(STAMP)
	@# One build at a time: both builds' plugins register JAX's cuda backend, the last loaded wins.
	@$(BIN)/pip uninstall -q -y $(foreach b,$(filter-out $*,$(GPU_BUILDS)),jax-$(b)-plugin \
	  jax-$(b)-pjrt) 2>/dev/null; rm -f $(filter-out $@,$(GPU_STAMPS))
	$(BIN)/pip install -q --disable-pip-version-check -c constraints.txt "jax[$*]"
	@# The stamp only once JAX sees the GPU, so that a rerun checks again; exit 1 says why not.
	$(BIN)/python -m runner.accelerator check
	touch $@

# Headless Chromium for the report pages' browser test (tests/integration/test_report_browser.py):
# Debian's package, installed as root with apt when missing; elsewhere that test skips, saying why.
browser:
	@command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null \
	  && (apt-get install -y -q chromium >/dev/null 2>&1 || (apt-get update -q >/dev/null 2>&1 \
	  && apt-get install -y -q chromium >/dev/null 2>&1)) && echo "chromium: installed"; } \
	  || echo "chromium not installed here: the report's browser test skips"

# Pretrain a V-MoE on embedded MNIST, fine-tune it on embedded UCI digits, evaluate, print a table.
demo: install
	$(WITH_JEMALLOC) $(BIN)/python -m runner.demo

# Fast suite: every subcommand end to end on tiny configs (slow tests are in test-full), and the
# import contracts of pyproject.toml (lint-imports, tests/unit/test_import_contracts.py).
# Groups (a module, or an xdist_group) go to the workers in the order they are collected: the
# integration modules, the 8-device processes among them, before the shorter unit modules (xdist
# would order them by their number of tests, which says nothing of their time).
PYTEST_XDIST = -n 2 --dist loadgroup --no-loadscope-reorder
test: install browser
	$(WITH_JEMALLOC) $(BIN)/python -m pytest -q -m "not slow" $(PYTEST_XDIST)

test-full: install browser
	$(WITH_JEMALLOC) $(BIN)/python -m pytest -q $(PYTEST_XDIST)

# Sweeps, multi-process jobs, preemption and searches on a real single-node SLURM started here
# (installed with apt when missing; needs root, else the tests say why and skip).
test-cluster: install
	$(BIN)/python -m pytest -q -p no:cacheprovider tests/cluster

# What `vmoe export` writes, run in PyTorch (CPU build) and compared with `vmoe eval` (docs/export.md);
# timm and transformers ViTs read by vmoe, compared with those libraries' own forward pass
# (docs/released-checkpoints.md).
test-export: install $(VENV)/.installed-torch
	$(WITH_JEMALLOC) $(BIN)/python -m pytest -q -p no:cacheprovider tests/export

# The CUDA builds `make install GPU=...` installs resolve at constraints.txt's versions, with every
# NVIDIA library pinned, and pyproject's requires-python is the Pythons the pinned wheels exist
# for (the registry's metadata only; nothing of CUDA is downloaded).
test-install: install
	$(BIN)/python -m pytest -q -p no:cacheprovider tests/install

$(VENV)/.installed-torch: $(STAMP)
	$(BIN)/pip install -q --disable-pip-version-check -c constraints.txt -e '.[torch]'
	touch $@

# The efficient-ensembles paper's comparison on the embedded data (docs/ensembles.md).
study-ensembles: install
	$(WITH_JEMALLOC) $(BIN)/python -m runner.studies.ensembles

# The HET-XL paper's comparison of classifier heads on the embedded data (docs/heads.md).
study-heads: install
	$(WITH_JEMALLOC) $(BIN)/python -m runner.studies.heads

# Router families at matched compute (docs/routers.md): ViT, token-choice k=1/k=2, experts-choice, Soft MoE.
study-routers: install
	$(WITH_JEMALLOC) $(BIN)/python -m runner.studies.routers

# Load balancing and DeepSeek-style routing at matched compute, three seeds (docs/routers.md).
study-balance: install
	$(WITH_JEMALLOC) $(BIN)/python -m runner.studies.balance

# DET vs HET-XL contrastive learning, LiT from the demo's V-MoE, zero-shot on held-out prompts (docs/contrastive.md).
study-contrastive: install
	$(WITH_JEMALLOC) $(BIN)/python -m runner.studies.contrastive

# Upcycling (sparse, Drop-Upcycling) and expert compression (prune, merge) at the demo's scale, three seeds (docs/compression.md).
study-experts: install
	$(WITH_JEMALLOC) $(BIN)/python -m runner.studies.experts

# `make bench ARGS=--record` replaces the tracked records in benchmarks/results/ (otherwise a run's
# results go to runs/benchmarks/, which git ignores).
bench: install
	$(WITH_JEMALLOC) $(BIN)/python -m benchmarks.run_all $(ARGS)

# V-MoE-S/32 and -B/16 train steps on one GPU, within 8 minutes (benchmarks/README.md). It needs
# only jax, flax, optax and numpy, so it runs on a CUDA JAX image without `install` (TensorFlow):
# .venv's python if there is one, else python3. `make bench-gpu ARGS=--small`: the CPU smoke run.
bench-gpu:
	PYTHONPATH="$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH}" \
	  $(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON)) -m benchmarks.gpu $(ARGS)

clean:
	rm -rf $(VENV) runs outputs multirun
