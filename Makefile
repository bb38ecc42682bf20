# flowtrain: two commands. `make demo` runs the main job, `make test` runs the tests.
# Both create or reuse .venv and install from constraints.txt. `make demo` needs nothing else (the batch
# job uses neither Kafka nor Prism); `make test` also provisions the Kafka jars and Prism up front, and
# `flowtrain kafka start` / a streaming run provision them on first use.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.flowtrain-installed

.PHONY: install provision test test-fast test-slow demo bench clean-venv

install: $(STAMP) provision

$(STAMP): pyproject.toml constraints.txt
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -c constraints.txt -e '.[test,demo]'
	@touch $(STAMP)

# Kafka broker jars (mvn, Maven Central) and the Prism runner (go install), cached per machine.
provision: $(STAMP)
	$(BIN)/python -m flowtrain.local.provision

test: install
	$(BIN)/python -m flowtrain.local.provision --only-flink  # the Flink tests run a real cluster
	$(BIN)/python -m pytest -m "not slow" -v --durations=15

# The fast lane: no broker, no runner, no cluster (under 2 minutes); run it while you work.
test-fast: $(STAMP)
	$(BIN)/python -m pytest tests/unit -m "not slow and not kafka and not streaming and not flink" -q -p no:cacheprovider

test-slow: install
	$(BIN)/python -m pytest -m slow -v

demo: $(STAMP)
	$(BIN)/flowtrain batch --out runs/demo

bench: install
	$(BIN)/flowtrain bench all

clean-venv:
	rm -rf $(VENV)
