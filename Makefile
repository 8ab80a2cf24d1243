# Every target works on a fresh machine: `install` creates the virtual environment first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
MODEL ?= bert-tiny
TARGET ?= llvm
ARGS ?=

.PHONY: install demo test test-fast lint trace convert optimize tune build verify bench run benchmarks clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev,peers,serve,embed,ray]'
	touch $@

demo: install
	$(BIN)/tvmbert run configs/demo.yaml

test: install
	$(BIN)/pytest -q -n 2 --dist worksteal --durations=25

test-fast: install
	$(BIN)/pytest -q -n 2 -m "not slow"

lint: install
	$(BIN)/ruff check tvmbert tests

# Stage targets for CI pipelines, e.g. `make bench MODEL=bert-base TARGET=llvm ARGS=--json`.
trace convert optimize tune build verify bench: install
	$(BIN)/tvmbert $@ $(MODEL) --target '$(TARGET)' $(ARGS)

run: install
	$(BIN)/tvmbert run $(CONFIG) $(ARGS)

# Regenerates the measured tables that docs/benchmarks.md shows (bert-base, this machine).
benchmarks: install
	$(BIN)/tvmbert bench bert-base --seq-len 14,128,384,512 --repeat 20 --min-time 5 --markdown docs/bench-bert-base-cpu.md \
		--plot docs/bench-bert-base-cpu.png --json > docs/bench-bert-base-cpu.json

clean:
	rm -rf build
