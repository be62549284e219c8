# Fresh machine: `make demo` sets everything up and runs the main job; `make test` runs the tests.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
VLLM_VENV := $(VENV)/vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
# locks/vllm.lock pins torch==2.13.0+cpu: PyPI serves no "+cpu" local versions, PyTorch's CPU wheel index does
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu

HARBOR_VENV := .venv-harbor
PYTHON312 ?= python3.12

.PHONY: venv demo test test-all lint system-deps harbor clean gpu-check gpu-wheels

# Ray (locks/ray.lock) places a run's services on a cluster with `--placement ray` (docs/cluster.md);
# it installs with the main locks. It stays optional (pyproject.toml's `ray` extra): the package
# installs and runs without it (tests/test_packaging.py).
# OpenEnv 0.3 (locks/openenv03.lock) installs the same `openenv` package as the current line
# in locks/env.lock, so it goes to its own directory, with the venv's dependencies;
# tests/env/server/test_openenv_clients.py runs its clients from there in a subprocess.
$(STAMP): locks/base.lock locks/env.lock locks/ray.lock locks/openenv03.lock locks/swebench.lock pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -r locks/base.lock -r locks/env.lock -r locks/ray.lock
	$(PY) -m pip install -q --disable-pip-version-check --no-deps --upgrade --target $(VENV)/openenv-0.3 \
	  -r locks/openenv03.lock
	$(PY) -m pip install -q --disable-pip-version-check --no-deps --upgrade --target $(VENV)/swebench \
	  -r locks/swebench.lock
	$(PY) -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
	touch $(STAMP)

# vLLM (locks/vllm.lock: its own pins of torch, transformers, mcp, fastapi) gets a virtualenv of its own,
# .venv/vllm, which the vLLM sampler (rl.sampler_engine: vllm) runs from; its lock is complete, so it
# installs with --no-deps. Its CPU torch (torch==2.13.0+cpu) is not on PyPI: it comes from PyTorch's CPU
# index (TORCH_CPU_INDEX). The install tries pip's configured indexes first (a mirror or wheel folder that
# carries the build resolves it without reaching out; an unreachable extra index would cost pip's retries
# on every one of the lock's packages), then again with PyTorch's index added. vLLM is optional: a failed
# install warns and `make` goes on, unstamped, so the next `make venv` tries again.
VLLM_PIP = $(VLLM_VENV)/bin/pip install -q --disable-pip-version-check --no-deps
$(VLLM_STAMP): locks/vllm.lock
	@if { test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV); } && \
	  { $(VLLM_PIP) -r locks/vllm.lock >/dev/null 2>&1 || \
	    $(VLLM_PIP) --extra-index-url $(TORCH_CPU_INDEX) -r locks/vllm.lock; }; then \
	  touch $@; \
	else echo "warning: could not install vLLM into $(VLLM_VENV) (\`make venv\` tries again); the vLLM sampler's tests will be skipped"; fi

venv: $(STAMP) $(VLLM_STAMP)

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

# Harbor's linter (tests/env/tasks/test_harbor_tasks.py) needs Python 3.12: its own venv when one is found.
$(HARBOR_VENV)/.installed: locks/harbor.lock
	@if $(PYTHON312) -c "" >/dev/null 2>&1; then \
	  $(PYTHON312) -m venv $(HARBOR_VENV) && \
	  $(HARBOR_VENV)/bin/pip install -q --disable-pip-version-check -r locks/harbor.lock && \
	  touch $@ || echo "warning: could not install Harbor; its linter test will be skipped"; \
	else echo "warning: no working $(PYTHON312) (set PYTHON312=...); Harbor's linter test will be skipped"; fi

harbor: $(HARBOR_VENV)/.installed

demo: venv system-deps
	$(PY) -m composer_jax.cli demo

lint: venv
	$(VENV)/bin/ruff check src tests bench pallas_kernels tools
	$(VENV)/bin/ruff format --check src tests bench pallas_kernels tools
	$(VENV)/bin/mypy src/composer_jax pallas_kernels bench tests tools

test: venv system-deps harbor lint
	$(PY) -m pytest -n 2 --dist worksteal -m "not slow" --durations=30 tests

test-all: venv system-deps harbor
	COMPOSER_JAX_TEST_XLA_OPT=default $(PY) -m pytest -n 2 tests

# issue 42: the GPU check (bench/gpu_check.py). On a GPU machine: `make gpu-check OUT=DIR`; on CPU,
# every section at tiny shapes: `make gpu-check DRY_RUN=1`. A device call carries .whl/ (`make
# gpu-wheels`: the wheels bench/gpu_wheels.txt lists, which the device image lacks) and runs
# `bash bench/gpu_check.sh $OUT` (docs/gpu.md).
gpu-check: venv
	$(PY) bench/gpu_check.py --out $(or $(OUT),gpu-check) $(if $(DRY_RUN),--dry-run)

gpu-wheels: venv
	mkdir -p .whl
	grep -v '^#' bench/gpu_wheels.txt | cut -d' ' -f1 | xargs $(PY) -m pip download -q --no-deps \
	  --only-binary=:all: --python-version 3.12 --implementation cp -d .whl \
	  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
	  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64

clean:
	rm -rf $(VENV) $(HARBOR_VENV) build *.egg-info src/*.egg-info
