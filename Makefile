# Two commands (README): `make train` and `make test`. Each sets up .venv first; `make test` also installs
# Chromium for the dashboard's browser tests where it can, or says that it skips them (scripts/test-browser.sh).
# `make train` keeps the engine's JSON lines in runs/ANDREA-tiny/train.jsonl; progress goes to the terminal.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: train test check setup setup-test

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

setup: $(BIN)/python
	$(BIN)/pip install -q -e .

setup-test: $(BIN)/python
	$(BIN)/pip install -q -e '.[test]'

train: setup
	@mkdir -p runs/ANDREA-tiny
	$(BIN)/microgpt train experiments/ANDREA-tiny-TRAIN.json --out runs/ANDREA-tiny --resume latest \
	  >> runs/ANDREA-tiny/train.jsonl
	@for prompt in "def " "class " "import "; do \
	  echo "--- sample: $$prompt"; $(BIN)/microgpt sample runs/ANDREA-tiny --prompt "$$prompt" --tokens 200; done

test: setup-test
	@. scripts/test-browser.sh && $(BIN)/python -m pytest -q

check: setup-test
	$(BIN)/ruff format --check microgpt tests bench scripts dev
	$(BIN)/ruff check microgpt tests bench scripts dev
