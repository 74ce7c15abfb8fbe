# Every target installs what it needs first; `make demo` and `make test` work on a fresh clone.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# Quiet TensorFlow, keep tfds/keras/W&B caches inside the checkout.
export TF_CPP_MIN_LOG_LEVEL := 3
export TF_ENABLE_ONEDNN_OPTS := 0
export WANDB_SILENT := true

.PHONY: install demo test test-full bench clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check -c constraints.txt -e '.[test]'
	touch $(STAMP)

# Pretrain a V-MoE on embedded MNIST, fine-tune it on embedded UCI digits, evaluate, print a table.
demo: install
	$(BIN)/python -m runner.demo

# Fast suite: every subcommand end to end on tiny configs (slow tests are in test-full).
test: install
	$(BIN)/python -m pytest -q -m "not slow" -n 2 --dist loadgroup

test-full: install
	$(BIN)/python -m pytest -q -n 2 --dist loadgroup

bench: install
	$(BIN)/python -m benchmarks.run_all

clean:
	rm -rf $(VENV) runs outputs multirun
