# hpctrain: `make demo` runs the main job, `make test` runs every test. Both set up .venv first.
VENV ?= .venv
PY := $(VENV)/bin/python
RANKS ?= 2

.PHONY: setup demo test bench clean

setup:
	@bash scripts/setup.sh

demo: setup
	$(PY) benchmarks/allreduce.py --ranks $(RANKS) --quick --out results/demo

test: setup
	$(PY) -m pytest tests

bench: setup
	$(PY) benchmarks/allreduce.py --ranks 2 4 --out results/allreduce

clean:
	rm -rf results .pytest_cache
