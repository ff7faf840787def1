# The two commands of the README, and their set-up.
#   make demo   set up, then run the whole pipeline locally and open the console
#   make test   set up (with the test services: clickhouse-server, zookeeper, chromium), then run every test
PY := .venv/bin/python

# A real Apache Kafka for the tests that must meet it (tests/integration/test_apache_kafka.py): the one beside
# this checkout (../shared/kafka) unless STRAGGLERSCOPE_APACHE_KAFKA names another; without one they are skipped.
ifneq ($(wildcard ../shared/kafka/lib),)
export STRAGGLERSCOPE_APACHE_KAFKA ?= $(abspath ../shared/kafka)
endif

.PHONY: setup setup-test demo demo-once test test-unit bench clean

.venv/.installed: pyproject.toml infra/local/setup.sh
	bash infra/local/setup.sh
	touch $@

.venv/.installed-test: .venv/.installed infra/local/setup.sh
	bash infra/local/setup.sh --test
	touch $@

# The what-if analyzer's compiled kernels, compiled here once (cached beside the module) rather than
# inside the first pipeline shard or test that meets them; again when kernels.py changes.
.venv/.kernels: .venv/.installed analyzers/whatif/kernels.py
	@echo "setup: compiling the what-if analyzer's kernels (once, about 20 s)" >&2
	$(PY) -c "from analyzers.whatif.kernels import warm; warm()"
	touch $@

setup: .venv/.installed .venv/.kernels
setup-test: .venv/.installed-test .venv/.kernels

demo: setup
	.venv/bin/stragglerscope demo

demo-once: setup
	.venv/bin/stragglerscope demo --headless --once

test: setup-test
	$(PY) -m pytest

test-unit: setup-test
	$(PY) -m pytest -m "not integration"

clean:
	rm -rf .venv .stragglerscope tests/artifacts
