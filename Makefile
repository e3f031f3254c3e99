PY := .venv/bin/python

.PHONY: setup cuda-build test test-long test-fast lint demo clean

setup:  ## venv, torch + vLLM, this package with its C++ copier, tiny models
	bash scripts/setup.sh

cuda-build:  ## offload._copier_cuda for sm_80/sm_90 with nvcc from the package index, GPU or not (setup runs it)
	bash scripts/cuda_build.sh

test:  ## the default suite, real vLLM engines included (docs/development.md)
	$(PY) -m pytest -q -p no:cacheprovider --durations=25

test-long:  ## the long runs: reliability and chaos on real engines, real geometries, peers (docs/development.md)
	$(PY) -m pytest -q -p no:cacheprovider -m long --durations=25

test-fast:  ## unit tests only (no engines)
	$(PY) -m pytest -q -p no:cacheprovider -m "not e2e"

lint:  ## ruff over the repository; mypy over offload/planner, offload/store, offload/connector and harness/
	$(PY) -m ruff check .
	$(PY) -m mypy offload/planner offload/store offload/connector harness

demo:  ## kvoffload warmup --verify (cross-restart warm-up) on the embedded tiny hybrid model
	$(PY) -m offload.demo $(DEMO_ARGS)

clean:
	rm -rf build *.egg-info offload/*.so .cache/demo

.PHONY: bench
bench:  ## the benchmarks at full size (hours with peer_race on 2 cores; best on an idle machine); JSON in bench/results/ (docs/performance.md)
	mkdir -p $(or $(BENCH_DIR),$(CURDIR)/.cache)
	$(PY) bench/build_model.py .models
	$(PY) -m bench.cpu_tier $(BENCH_ARGS)
	$(PY) -m bench.fs_tier --dir $(or $(BENCH_DIR),$(CURDIR)/.cache) $(BENCH_ARGS)
	$(PY) -m bench.lookup --dir $(or $(BENCH_DIR),$(CURDIR)/.cache)
	$(PY) -m bench.room_check
	$(PY) -m bench.e2e --cache-dir $(or $(BENCH_DIR),$(CURDIR)/.cache)
	$(PY) -m bench.warm_start --dir $(or $(BENCH_DIR),$(CURDIR)/.cache)
	$(PY) -m bench.peer_race --dir $(or $(BENCH_DIR),$(CURDIR)/.cache) $(RACE_ARGS)
	$(PY) -m bench.peer_race --multi-turn --dir $(or $(BENCH_DIR),$(CURDIR)/.cache) $(MULTI_TURN_ARGS)
	$(PY) -m bench.multi_turn_client --dir $(or $(BENCH_DIR),$(CURDIR)/.cache) $(MT_CLIENT_ARGS)
	$(MAKE) bench-scale
	$(PY) -m bench.charts

.PHONY: charts
charts:  ## PNG charts of the committed results in bench/results/*.json, written beside them (docs/performance.md#charts)
	$(PY) -m bench.charts

.PHONY: bench-scale
bench-scale:  ## 1M chunk files, pre-ledger walk vs ledger (~35 min on 2 shared cores; ~4 GB, 1M inodes, deleted after)
	mkdir -p $(or $(BENCH_DIR),$(CURDIR)/.cache)
	$(PY) -m bench.scale --dir $(or $(BENCH_DIR),$(CURDIR)/.cache) $(SCALE_ARGS)
