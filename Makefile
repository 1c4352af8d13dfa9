# The two commands of the README: `make run` (install + the main job) and `make test`.
PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
# Per-test timeout of the slow tier, seconds.
SLOW_TIMEOUT ?= 900

.PHONY: install install-robot run test test-slow lint duplicates docs bench clean

$(BIN)/python:
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "need $(PYTHON) (Python 3.11) on PATH, or run: make PYTHON=/path/to/python3.11"; exit 2; }
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $@

install: $(VENV)/.installed

## The robot side alone, in its own venv: no torch, no PyBullet (docs/perception.md).
ROBOT_VENV ?= robot-venv
install-robot:
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "need $(PYTHON) (Python 3.11) on PATH, or run: make PYTHON=/path/to/python3.11"; exit 2; }
	$(PYTHON) -m venv $(ROBOT_VENV)
	$(ROBOT_VENV)/bin/python -m pip install -q --disable-pip-version-check -r requirements-robot.txt
	$(ROBOT_VENV)/bin/python -m pip install -q --disable-pip-version-check --no-deps .
	$(ROBOT_VENV)/bin/python -c "import importlib.util as u, perception.robot.service; assert u.find_spec('torch') is None, 'torch got in'"
	@echo "robot side installed in $(ROBOT_VENV): $(ROBOT_VENV)/bin/sim2real-serve artifact=DIR calibration=FILE"

## The main job: the whole pipeline on its built-in defaults (budget=tiny).
run: install
	$(BIN)/sim2real-pipeline budget=tiny

## The fast test tier (under 10 minutes on 2 cores).
test: install
	$(BIN)/pytest -q

## The slow tier, with a timeout per test (pytest exit 5, "no tests", is fine).
test-slow: install
	$(BIN)/pytest -q -m slow --timeout=$(SLOW_TIMEOUT) || [ $$? -eq 5 ]

lint: install
	$(BIN)/ruff check .

## Code written twice (pylint's duplicate-code, six lines; settings in pyproject.toml): run by .ci/run.
duplicates: install
	$(BIN)/pylint conf perception sim_render adaptation policies benchmarks tests

## The documentation site (mkdocs.yml) into site/: the generated reference pages must be
## current (docs/gen_reference.py), and any warning (a broken link or anchor) fails it.
docs: install
	$(BIN)/python docs/gen_reference.py --check
	$(BIN)/mkdocs build --strict --quiet

bench: install
	$(BIN)/python benchmarks/render.py

clean:
	rm -rf outputs .pytest_cache
