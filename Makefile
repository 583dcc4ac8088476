# hpctrain: `make demo` runs the main job, `make test` runs every test. Both set up .venv first.
VENV ?= .venv
PY := $(VENV)/bin/python
RANKS ?= 2

.PHONY: setup demo allreduce-demo test test-fast bench clean

setup:
	@bash scripts/setup.sh

demo: setup
	$(VENV)/bin/hpctrain launch -n $(RANKS) python examples/torch_digits.py --out results/demo.json --checkpoint-dir results/demo-ckpt --metrics-dir results/demo-metrics

allreduce-demo: setup
	$(PY) benchmarks/allreduce.py --ranks $(RANKS) --quick --out results/allreduce-demo

# Every test; ends with the launches' times, the slowest tests and the total wall time (set-up included); every
# test's time goes to results/test-times.xml (JUnit XML).
test:
	@start=$$(date +%s); bash scripts/setup.sh && $(SPEED) && $(PY) -m pytest tests --durations=25 --junitxml=results/test-times.xml; rc=$$?; \
	echo "make test: total wall time $$(( $$(date +%s) - start )) s (set-up included), exit status $$rc"; $(SPEED); exit $$rc

# How fast this machine runs Python (CONTRIBUTING, "The budget": read a CI figure against it).
SPEED = $(PY) -c 'import time; t = time.perf_counter(); exec("s = 0\nfor i in range(10**7): s += i"); \
	print(f"make test: 10^7 Python additions took {time.perf_counter() - t:.2f} s on this machine")'

# The edit-test loop (a few minutes): single-process tests, the collectives at 2 ranks, one 2-rank training.
FAST_FILES := test_api test_compression test_data test_hostcopy test_pipeline_schedule test_results \
	test_slurm_hosts test_launch test_settings test_layering test_storage test_multirank
test-fast: setup
	$(PY) -m pytest $(FAST_FILES:%=tests/%.py) --durations=10 \
	    -k "not test_multirank or test_ranks and (test_collectives.py-2 or test_one_node_paths.py-2 or test_torch_training.py-2)"

bench: setup
	$(PY) benchmarks/allreduce.py --ranks 2 4 --out results/allreduce
	$(PY) benchmarks/fusion.py --ranks 2 4 --out results/fusion
	$(PY) benchmarks/scaling.py --ranks 1 2 4 --out results/scaling
	$(PY) benchmarks/scaling.py --framework tf --ranks 1 2 4 --out results/scaling-tf
	$(PY) benchmarks/checkpoint.py --out results/checkpoint
	$(PY) benchmarks/compression.py --out results/compression
	$(PY) benchmarks/pipeline.py --out results/pipeline
	@if [ "$$(id -u)" = 0 ]; then $(PY) benchmarks/multinode.py --out results/multinode && \
		$(PY) benchmarks/model.py --runs results/multinode/multinode.json --out results/model; \
	else echo "skipping benchmarks/multinode.py and model.py: fake nodes need root"; fi

clean:
	rm -rf results .pytest_cache
