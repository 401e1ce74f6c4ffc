# Two commands (README): `make train` and `make test`, each in its own virtual environment, so one never changes
# the other's packages: .venv (what `make train` uses, and the README's later commands: the engine's own needs,
# any NumPy from 1.26) and .venv-test (the test extra, whose Triton interpreter pins NumPy below 2.3). Each is set up
# once: a stamp file inside it is newer than pyproject.toml until pyproject.toml changes.
# `make test` also installs Chromium for the dashboard's browser tests where it can, or says that it skips them
# (scripts/test-browser.sh). `train` trains the modern recipe (experiments/ANDREA-tiny-MODERN-TRAIN.json) and writes
# runs/ANDREA-tiny-MODERN/train.jsonl (its log) and report.md itself. The seed's GPT-2 recipe is one command away:
# `make train EXP=experiments/ANDREA-tiny-TRAIN.json RUN=runs/ANDREA-tiny` (README, "Which recipe").
# RUN, EXP and TRAIN_FLAGS also let a test run these recipes small, elsewhere (tests/test_readme_flow.py).
PY ?= python3
VENV ?= .venv
TEST_VENV ?= .venv-test
BIN := $(VENV)/bin
TEST_BIN := $(TEST_VENV)/bin
EXP ?= experiments/ANDREA-tiny-MODERN-TRAIN.json
RUN ?= runs/ANDREA-tiny-MODERN
TRAIN_FLAGS ?=
SAMPLE_TOKENS ?= 200

GGUF_VENV ?= .venv-gguf

.PHONY: train test check setup setup-test check-gguf

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e .
	touch $@

$(TEST_VENV)/.installed: pyproject.toml
	test -x $(TEST_BIN)/python || $(PY) -m venv $(TEST_VENV)
	$(TEST_BIN)/pip install -q --upgrade pip
	$(TEST_BIN)/pip install -q -e '.[test]'
	touch $@

setup: $(VENV)/.installed

setup-test: $(TEST_VENV)/.installed

train: setup
	$(BIN)/microgpt train $(EXP) --out $(RUN) --resume latest $(TRAIN_FLAGS)
	@for prompt in "def " "class " "import "; do \
	  echo "--- sample: $$prompt"; $(BIN)/microgpt sample $(RUN) --prompt "$$prompt" --tokens $(SAMPLE_TOKENS) || exit; done

test: setup-test
	@. scripts/test-browser.sh && $(TEST_BIN)/python -m pytest -q

check: setup-test
	$(TEST_BIN)/ruff format --check microgpt tests bench scripts dev
	$(TEST_BIN)/ruff check microgpt tests bench scripts dev

# The GGUF export against the real llama.cpp (tests/test_export_gguf.py): llama-cpp-python compiles llama.cpp when it
# installs (minutes), so it has a venv of its own and CI reads the files with the gguf package instead.
$(GGUF_VENV)/.installed: pyproject.toml
	test -x $(GGUF_VENV)/bin/python || $(PY) -m venv $(GGUF_VENV)
	$(GGUF_VENV)/bin/pip install -q --upgrade pip
	CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) $(GGUF_VENV)/bin/pip install -q -e '.[llama]'
	touch $@

check-gguf: $(GGUF_VENV)/.installed
	MICROGPT_LLAMA_CPP=require $(GGUF_VENV)/bin/python -m pytest -q tests/test_export_gguf.py
