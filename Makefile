PY := .venv/bin/python

.PHONY: setup test test-fast demo clean

setup:  ## venv, torch + vLLM, this package with its C++ copier, tiny models
	bash scripts/setup.sh

test:  ## the whole suite, real vLLM engines included
	$(PY) -m pytest -q -p no:cacheprovider

test-fast:  ## unit tests only (no engines)
	$(PY) -m pytest -q -p no:cacheprovider -m "not e2e"

demo:  ## cross-restart warm-up run on the embedded tiny hybrid model
	$(PY) -m offload.demo $(DEMO_ARGS)

clean:
	rm -rf build *.egg-info offload/*.so .cache/demo
