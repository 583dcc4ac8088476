# hpctrain: `make demo` runs the main job, `make test` runs every test. Both set up .venv first.
VENV ?= .venv
PY := $(VENV)/bin/python
RANKS ?= 2

.PHONY: setup demo allreduce-demo test bench clean

setup:
	@bash scripts/setup.sh

demo: setup
	$(VENV)/bin/hpctrain launch -n $(RANKS) python examples/torch_digits.py --out results/demo.json --checkpoint-dir results/demo-ckpt

allreduce-demo: setup
	$(PY) benchmarks/allreduce.py --ranks $(RANKS) --quick --out results/allreduce-demo

test: setup
	$(PY) -m pytest tests

bench: setup
	$(PY) benchmarks/allreduce.py --ranks 2 4 --out results/allreduce
	$(PY) benchmarks/fusion.py --ranks 2 4 --out results/fusion
	$(PY) benchmarks/scaling.py --ranks 1 2 4 --out results/scaling
	$(PY) benchmarks/scaling.py --framework tf --ranks 1 2 4 --out results/scaling-tf
	$(PY) benchmarks/checkpoint.py --out results/checkpoint
	$(PY) benchmarks/compression.py --out results/compression
	$(PY) benchmarks/pipeline.py --out results/pipeline

clean:
	rm -rf results .pytest_cache
