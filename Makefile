# Two commands do all the set-up on a fresh machine: `make train` and `make test`.
# Both create .venv if missing and install conveyor into it; a second run only
# checks that the install is current (a stamp file newer than pyproject.toml).

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU wheel of torch; a GPU machine can pass TORCH_SPEC=torch (any build it has).
TORCH_SPEC ?= torch==2.13.0
EXTRAS ?= dev,plot,tensorboard,wandb,mlflow,ray
STAMP := $(VENV)/.installed

.PHONY: install train test bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	@touch $(STAMP)

train: install
	$(VENV)/bin/conveyor train $(ARGS)

test: install
	$(PY) -m pytest tests $(PYTEST_ARGS)

bench: install
	$(PY) -m pip install -q -r benchmarks/requirements.txt
	$(PY) benchmarks/run_all.py

clean:
	rm -rf $(VENV) runs .pytest_cache
