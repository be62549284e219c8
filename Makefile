# Fresh machine: `make demo` sets everything up and runs the main job; `make test` runs the tests.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv demo test test-all lint system-deps clean

$(STAMP): requirements.lock requirements-env.lock pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -r requirements.lock -r requirements-env.lock
	$(PY) -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
	touch $(STAMP)

venv: $(STAMP)

# bubblewrap is the environment server's sandbox, bazel-bootstrap is Bazel 4 for the BUILD file
# (tests/test_bazel.py); Debian packages, installed when we can.
system-deps:
	@command -v bwrap >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    (apt-get update -qq && apt-get install -y -qq bubblewrap) >/dev/null 2>&1 || echo "warning: could not install bubblewrap"; \
	  else echo "warning: bubblewrap (bwrap) not found; sandbox tests will be skipped"; fi; }
	@command -v bazel >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bazel-bootstrap) >/dev/null 2>&1 || echo "warning: could not install bazel-bootstrap"; \
	  else echo "warning: bazel not found; Bazel build tests will be skipped"; fi; }

demo: venv system-deps
	$(PY) -m composer_jax.cli demo

lint: venv
	$(VENV)/bin/ruff check src tests bench pallas_kernels tools
	$(VENV)/bin/ruff format --check src tests bench pallas_kernels tools
	$(VENV)/bin/mypy src/composer_jax pallas_kernels bench tests tools

test: venv system-deps lint
	$(PY) -m pytest -n 2 -m "not slow" tests

test-all: venv system-deps
	$(PY) -m pytest -n 2 tests

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
