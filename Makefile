PY ?= .venv/bin/python
.PHONY: venv lint test bench demo gpu-check

venv:
	bash .ci/setup-venv

lint: venv
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

test: lint
	$(PY) -m pytest -q -m "not slow" -p no:cacheprovider; rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 0; fi; exit $$rc

bench: venv
	$(PY) -m pytest bench -q --benchmark-only --benchmark-columns=median,iqr,rounds

demo: venv
	$(PY) -m kvhit demo

gpu-check:
	bash bench/gpu_check.sh
