PY ?= .venv/bin/python
.PHONY: venv lint test bench sweep demo gpu-check

venv:
	bash .ci/setup-venv

lint: venv
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

test: lint
	$(PY) -m pytest -q -m "not slow" -p no:cacheprovider; rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 0; fi; exit $$rc

bench: venv
	$(PY) -m pytest bench -q --benchmark-only --benchmark-columns=median,iqr,rounds

# kvhit bench's full CPU sweep with the vLLM column, as bench/RESULTS.md records it
sweep: venv
	mkdir -p bench/out
	$(PY) -m kvhit bench --vllm --key-index --json bench/out/cpu.json --plot bench/results_cpu.png

demo: venv
	$(PY) -m kvhit demo

gpu-check:
	bash bench/gpu_check.sh
