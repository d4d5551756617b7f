# The two set-up commands of README.md, and what they need. Each creates the virtual environment.
VENV ?= .venv
# vLLM's CPU build pins other transformers than the project: its own environment.
VLLM_VENV ?= .venv-vllm
PYTHON ?= python3
PY := $(VENV)/bin/python
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: run serve test lint format install vllm-env bench

$(VENV)/.installed: requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet -r requirements.txt
	touch $@

install: $(VENV)/.installed

# torchvision, torchaudio and torchcodec come from PyPI as CUDA builds that fail to import
# here (and `from vllm import LLM` breaks while torchcodec is installed); vLLM runs without
# them, and without triton (a gigabyte, unused on the CPU).
$(VLLM_VENV)/.installed: requirements-vllm.txt constraints-vllm.txt
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/pip install --quiet -c constraints-vllm.txt torch
	$(VLLM_VENV)/bin/pip install --quiet -c constraints-vllm.txt -r requirements-vllm.txt
	$(VLLM_VENV)/bin/pip uninstall --quiet --yes torchvision torchaudio torchcodec triton
	touch $@

vllm-env: $(VLLM_VENV)/.installed

run: $(VENV)/.installed
	$(PY) manage.py kvsp_cluster

# The control plane under the ASGI worker: requests in KVSP_HTTP_THREADS threads per worker,
# output event streams on the event loop (kvspsite/asgi.py).
serve: $(VENV)/.installed
	$(PY) manage.py migrate --no-input
	$(VENV)/bin/gunicorn kvspsite.asgi:application --bind $(HOST):$(PORT) \
		--workers 2 --worker-class asgi

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports --no-cache
	$(VENV)/bin/ruff format --check .

# The vLLM tests (tests/vllm) run in the same pytest run; they drive vLLM engines in
# processes of $(VLLM_VENV).
test: $(VENV)/.installed $(VLLM_VENV)/.installed lint
	DATABASE_URL=$${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/kvsp} \
	CELERY_BROKER_URL=$${CELERY_BROKER_URL:-redis://127.0.0.1:6379/0} \
	KVSP_VLLM_PYTHON=$(abspath $(VLLM_VENV))/bin/python \
	$(PY) -m pytest

format: $(VENV)/.installed
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

bench: $(VENV)/.installed $(VLLM_VENV)/.installed
	for script in bench/bench_*.py; do $(PY) $$script || exit 1; done
