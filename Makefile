# flowtrain: two commands. `make demo` runs the main job, `make test` runs the tests.
# Both create or reuse .venv and install from constraints.txt. `make demo` needs nothing else (the batch
# job uses neither Kafka nor Prism); `make test` also provisions the Kafka jars and Prism up front, and
# `flowtrain kafka start` / a streaming run provision them on first use.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.flowtrain-installed

.PHONY: install provision browser test test-fast test-slow test-multihost demo bench clean-venv

install: $(STAMP) provision

$(STAMP): pyproject.toml constraints.txt setup.py flowtrain/train/ids/probe.c
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -c constraints.txt -e '.[test,demo]'
	@touch $(STAMP)

# Kafka broker jars (mvn, Maven Central), the Prism runner (go install), Apicurio Registry (mvn) and Azurite
# (npm: the object-store tests' server), cached per machine.
provision: $(STAMP)
	$(BIN)/python -m flowtrain.local.provision

# The status page's browser test drives headless Chromium: Debian's chromium + chromium-driver (apt, once);
# the drift alerting rule in docs/observability.md is checked with promtool (Debian's prometheus package).
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
browser:
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null && command -v promtool >/dev/null || \
		($(SUDO) apt-get update && $(SUDO) apt-get install -y --no-install-recommends chromium chromium-driver prometheus)

# Each lane prints its 30 slowest tests and keeps a JUnit XML (every test's seconds) under test-results/: what
# the next change to the suite's time is guided by.
RESULTS := test-results
# `make test` on pytest-xdist's workers: a module's tests on one worker, a session service's (Flink, the registry,
# Azurite) on the worker that starts it (tests/conftest.py). TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 3

test: install browser
	$(BIN)/python -m flowtrain.local.provision --only-flink  # the Flink tests run a real cluster
	@mkdir -p $(RESULTS)
	$(BIN)/python -m pytest -m "not slow and not multihost" -n $(TEST_WORKERS) --dist loadgroup -v --durations=30 \
		--junitxml=$(RESULTS)/test.xml

# The fast lane: no broker, no runner, no cluster (under 2 minutes); run it while you work.
test-fast: $(STAMP)
	$(BIN)/python -m pytest tests/unit -m "not slow and not kafka and not streaming and not flink" -q -p no:cacheprovider -n 2

test-slow: install
	$(BIN)/python -m pytest -m slow -v

# Past one machine: hosts made of network namespaces (torchrun across hosts, a 3-broker Kafka cluster).
# Needs root or CAP_NET_ADMIN: without it the lane fails with one line saying why (never a silent skip).
test-multihost: install
	@$(BIN)/python -m tests.multihost.hosts
	$(BIN)/python -m flowtrain.local.provision --only-flink  # its Flink hosts run from the jars (no internet inside)
	@mkdir -p $(RESULTS)
	$(BIN)/python -m pytest tests/multihost -v -p no:cacheprovider --durations=30 --junitxml=$(RESULTS)/test-multihost.xml

demo: $(STAMP)
	$(BIN)/flowtrain batch --out runs/demo --id-columns tailnum,route

bench: install
	$(BIN)/flowtrain bench all

clean-venv:
	rm -rf $(VENV)
