# The two set-up commands of README.md, and what they need. Each creates the virtual environment.
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: run serve test lint format install bench

$(VENV)/.installed: requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet -r requirements.txt
	touch $@

install: $(VENV)/.installed

run: $(VENV)/.installed
	$(PY) manage.py kvsp_cluster

serve: $(VENV)/.installed
	$(PY) manage.py migrate --no-input
	$(VENV)/bin/gunicorn kvspsite.wsgi:application --bind $(HOST):$(PORT) \
		--workers 2 --worker-class gthread --threads 4

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: $(VENV)/.installed lint
	DATABASE_URL=$${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/kvsp} \
	CELERY_BROKER_URL=$${CELERY_BROKER_URL:-redis://127.0.0.1:6379/0} \
	$(PY) -m pytest

format: $(VENV)/.installed
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

bench: $(VENV)/.installed
	for script in bench/bench_*.py; do $(PY) $$script || exit 1; done
