# Developing nbaccel (README, docs/developing.md): `make demo` (the built-in 2-process CPU
# training) and `make test` (every suite, then a user's install from the wheel). Both create
# .venv (the lock: a developer's environment, not a user's) and install everything on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

XLA_VENV ?= .venv-xla
XLA_PY := $(XLA_VENV)/bin/python
XLA_STAMP := $(XLA_VENV)/.installed-stamp

NEWEST_VENV ?= .venv-newest
NEWEST_PY := $(NEWEST_VENV)/bin/python

.PHONY: demo test test-newest newest-venv lint unit multiprocess multihost notebook browser xla \
	install-check dashboard-image bench clean bytecode gpu-wheels test-gpu test-gpu-dry

# Everything from the lock (requirements/ci.txt, pip-compile'd from pyproject.toml and
# requirements/ci.in: see the README), then nbaccel itself with nothing more resolved.
# .ci/pip-install is pip install done by uv (several times faster), or by pip if uv fails.
$(STAMP): pyproject.toml requirements/ci.txt requirements/cloudpickle-oldest.txt requirements/uv.txt
	python3 -m venv $(VENV)
	.ci/pip-install $(VENV) --requirement requirements/ci.txt
	$(PY) -m pip install --quiet --no-deps --no-build-isolation --editable .
	$(PY) -m pip check
	# The oldest cloudpickle pyproject allows, beside the venv (not in it): the payload
	# tests also launch with it first on PYTHONPATH.
	$(PY) -m pip install --quiet --no-deps --target $(VENV)/cloudpickle-oldest \
		--requirement requirements/cloudpickle-oldest.txt
	touch $(STAMP)

# The torch_xla environment: torch 2.9 + torch_xla 2.9 (they must match), nbaccel from here.
# The script waits for a build already under way (.ci/run starts one in the background).
$(XLA_STAMP): pyproject.toml requirements/xla.txt requirements/uv.txt
	.ci/build-xla-venv $(XLA_VENV)

# nbaccel's bytecode, written once: where PYTHONDONTWRITEBYTECODE is set (as on the CI
# machine) every fresh process (a kernel, the helper, an agent, a test's script) would
# otherwise compile the package again, ~0.1 s each. compileall writes it all the same;
# an edited module is simply compiled again at its next import. Every venv here is made by
# python3 -m venv, so python3's bytecode is theirs.
bytecode:
	python3 -m compileall -q nbaccel

demo: $(STAMP)
	$(VENV)/bin/nbaccel demo

test: lint unit multiprocess multihost notebook browser xla install-check

lint: $(STAMP)
	$(PY) -m ruff check nbaccel tests benchmarks
	$(PY) -m ruff format --check nbaccel tests benchmarks
	$(PY) -m mypy

unit: $(STAMP) bytecode
	$(PY) -m pytest tests/unit

multiprocess: $(STAMP) bytecode
	$(PY) -m pytest tests/multiprocess

# Several machines over real SSH: Debian's sshd (installed by .ci/install-browser, a no-op
# once there), started by the tests' fixture on 127.0.0.2 and 127.0.0.3; and through srun
# on a real two-node Slurm cluster (Debian's slurm-wlm and munge, same script) on the same
# addresses. Seconds.
multihost: $(STAMP) bytecode
	.ci/install-browser
	$(PY) -m pytest tests/multihost

notebook: $(STAMP) bytecode
	$(PY) -m pytest tests/notebook

# JupyterLab in Debian's headless chromium (installed by .ci/install-browser, a no-op once there).
browser: $(STAMP) bytecode
	.ci/install-browser
	$(PY) -m pytest tests/browser

# torch_xla on its CPU device: real launches (python - and notebooks), SPMD/FSDPv2, the
# Accelerator on XLA. PJRT_DEVICE=CPU here; each test sets CPU_NUM_DEVICES for its workers.
xla: $(XLA_STAMP) bytecode
	PJRT_DEVICE=CPU $(XLA_PY) -m pytest tests/xla

# A new user's path (README, "Install"): the sdist and the wheel built from this checkout,
# a fresh venv holding only the lock's torch (the user's own build), the wheel installed
# there with [notebook], then the README's first code block and notebook 01 run in it
# (uv installs from its cache: 50-100 s in all on the 2-core CI machine).
install-check: $(STAMP)
	$(PY) -m pytest tests/install

# docs/images/dashboard.png: the README's picture, the browser test's screenshot of the
# dashboard in JupyterLab (Debian's chromium) half-way through a real run, made small.
dashboard-image: $(STAMP) bytecode
	.ci/install-browser
	.ci/dashboard-image $(PY)

# The newest releases pyproject.toml allows (no lock; on this machine pip's own cap keeps
# torch at the newest build on its disk): catches a dependency that moved since the lock
# was made. Re-resolves on every call.
# .ci/run builds this venv in the background while `make test` runs, then calls
# `make test-newest NEWEST_READY=1`. It runs the suites where each dependency meets nbaccel,
# not every suite again (CI must stay well under 30 minutes): the Accelerator's unit tests
# (in-process, on torch's and Accelerate's APIs); the launch, pickling (cloudpickle, and
# protocol 5's buffers of numpy, pandas, pyarrow and datasets in shared memory), the
# Accelerator and its parity with Accelerate, FSDP2 and DCP checkpoints (safetensors),
# torch elastic's restarts and comm hooks; kernels and widgets (ipykernel, ipywidgets,
# nbclient) with notebooks 01 (dashboard, failure) and 05 (Accelerate's code unchanged);
# the launch over ssh and the preflight (torch elastic's TCP rendezvous). The rest (the
# CLI, config, failures, detached runs, the docs' examples, the other notebooks) exercise
# nbaccel's own code on the same calls into those libraries, and run against the lock.
NEWEST_TESTS := tests/unit/accel \
	tests/multiprocess/test_launch.py tests/multiprocess/test_payload_pickling.py \
	tests/multiprocess/test_accelerator.py tests/multiprocess/test_accelerate_parity.py \
	tests/multiprocess/test_sharding.py tests/multiprocess/test_restarts.py \
	tests/multiprocess/test_step_breakdown.py tests/multiprocess/test_strategies.py \
	tests/multiprocess/test_options_wiring.py tests/multiprocess/test_shared_data.py \
	'tests/multiprocess/test_accel_checkpoint.py::test_resume_equals_the_uninterrupted_run[ddp]' \
	'tests/multiprocess/test_accel_checkpoint.py::test_resume_equals_the_uninterrupted_run[fsdp-sharded]' \
	tests/notebook/test_notebook_launch.py tests/notebook/test_kernel_interrupt.py \
	tests/notebook/test_per_node_kernels.py \
	'tests/notebook/test_example_notebooks.py::test_example_notebook_runs[01_quickstart_cpu]' \
	'tests/notebook/test_example_notebooks.py::test_example_notebook_runs[05_accelerate_code_unchanged]' \
	tests/multihost/test_preflight.py tests/multihost/test_hosts_launch.py

test-newest: $(if $(NEWEST_READY),,newest-venv) bytecode
	@grep -iE '^(torch|cloudpickle|ipykernel|ipywidgets|accelerate|safetensors)==' $(NEWEST_VENV)/resolved.txt
	$(NEWEST_PY) -m pytest $(NEWEST_TESTS)

newest-venv:
	test -x $(NEWEST_PY) || python3 -m venv $(NEWEST_VENV)
	$(NEWEST_PY) -m pip install --quiet --upgrade pip
	.ci/pip-install $(NEWEST_VENV) --upgrade --editable '.[dev]'
	$(NEWEST_PY) -m pip check
	$(NEWEST_PY) -m pip freeze --exclude-editable > $(NEWEST_VENV)/resolved.txt

bench: $(STAMP)
	$(PY) benchmarks/launch_latency.py
	$(PY) benchmarks/interrupt_latency.py
	$(PY) benchmarks/step_overhead.py
	$(PY) benchmarks/sharding_memory.py
	$(PY) benchmarks/multi_host_launch.py
	$(PY) benchmarks/slurm_launch.py

# The GPU check (docs/gpu-check.md). `make gpu-wheels` runs here: it fills .gpu-wheels/ with
# what the GPU machine lacks (Python 3.12 wheels; DeepSpeed built here). `make test-gpu` runs
# there, with the machine's own python3 (torch, Accelerate, transformers, pytest installed):
# the cuda tests, the parity programs on the GPU and the step-rate benchmark, each under its
# own time limit, 8 minutes in all, into one report ($$OUT/gpu-report.md, else gpu-check/).
# `make test-gpu-dry` runs the same plumbing here on the CPU (about a minute).
GPU_WHEELS ?= .gpu-wheels

gpu-wheels: $(STAMP)
	PY=$(PY) benchmarks/gpu_wheels.sh $(GPU_WHEELS)

test-gpu:
	python3 benchmarks/gpu_check.py --wheels $(GPU_WHEELS)

test-gpu-dry: $(STAMP) bytecode
	$(PY) benchmarks/gpu_check.py --dry-run --wheels $(GPU_WHEELS)

clean:
	rm -rf $(VENV) $(XLA_VENV) $(NEWEST_VENV) nbaccel_runs .pytest_cache .mypy_cache .ruff_cache
