# `make run`: create the pinned environment and build the default target (results/tiny/bench.json
# from the embedded demo corpus, on CPU). `make test`: same environment plus the test extras
# (requirements-test.txt, which takes the benchmarks' requirements-bench.txt), then ruff's pyflakes and bugbear
# checks (pyproject.toml [tool.ruff]), the test suite and the system tests. `make lint`: ruff and `snakemake --lint`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
export PATH := $(abspath $(BIN)):$(PATH)

.PHONY: env env-slurm run test test-all test-system lint dry-run clean-env scale scale-slice

$(VENV)/.installed: requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -r requirements.txt
	$(BIN)/python -m pip install -q --no-deps -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed requirements-test.txt requirements-bench.txt
	$(BIN)/python -m pip install -q -r requirements-test.txt
	touch $@

env: $(VENV)/.installed

# The SLURM executor plugin (pyproject's [slurm] extra) for workflow/profiles/slurm; not in `make env`, as it costs
# every snakemake command ~10 s where the SLURM client is installed but no controller answers (docs/slurm.md).
env-slurm: $(VENV)/.installed
	$(BIN)/python -m pip install -q -e '.[slurm]'

run: env
	$(BIN)/snakemake

# The scale corpus (corpus/scale/README.md): ~1 GB of downloads, ~4.3 GB of text, a few minutes; then e.g.
#   snakemake results/small@scale/anchors.json --config corpus=corpus/scale/data
scale: env
	$(BIN)/snakemake --cores 1 corpus/scale/BUILD.json

# The slice of it that travels to a GPU machine with the checkout (issue #41: b1's chain on one machine)
scale-slice: env
	$(BIN)/snakemake --cores 1 corpus/scale_slice/BUILD.json

# ruff and import-linter's floors first (a finding fails the build before the tests run), the default suite, then the system tests
# (test-system below).
test: $(VENV)/.installed-test
	$(BIN)/ruff check dormouse benchmarks tests
	$(BIN)/lint-imports
	$(BIN)/python -m pytest -q
	$(MAKE) --no-print-directory test-system

test-all: $(VENV)/.installed-test
	DORMOUSE_SLOW_TESTS=1 $(BIN)/python -m pytest -q

# System tests against the real thing: the SLURM profile on a one-node SLURM (slurm-wlm + munge, ~5 min) and the
# chat page in a headless Chromium (~10 s), their Debian packages apt-installed when root; each skipped with the
# reason when it cannot run. Part of test and test-all.
test-system: $(VENV)/.installed-test
	DORMOUSE_SLOW_TESTS=1 $(BIN)/python -m pytest -q -rs tests/test_slurm_real.py tests/test_serve_browser.py

lint: $(VENV)/.installed-test
	$(BIN)/ruff check dormouse benchmarks tests
	$(BIN)/lint-imports
	$(BIN)/snakemake --lint

dry-run: env
	for p in tiny small medium b1; do $(BIN)/snakemake -n --quiet rules -- results/$$p/bench.json || exit 1; done

clean-env:
	rm -rf $(VENV)
