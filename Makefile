# make install: .venv with everything; make serve: the service.
# make test: lint, types and the quick tier (every test not marked slow: unit, API, engine, one real
# Serve app); make test-all (CI): lint, types and every test (a 1-minute soak, overload, faults,
# fuzzing, Locust, own models, Prometheus, the browser) but those of make test-long (two-node
# clusters: autoscaling, rollouts, node loss; the 5-minute soak; AddressSanitizer) and the five
# benchmark runs of make test-benchmarks. All print the 15 slowest tests.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install test test-all test-long test-benchmarks lint typecheck serve

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy

# Two workers, each test group on one (tests/conftest.py says which and in what order).
PYTEST := $(BIN)/python -m pytest -q --durations=15 -n 2

test: lint typecheck
	$(PYTEST) -m "not slow and not benchmarks"

test-all: lint typecheck
	$(PYTEST) -m "not benchmarks and not long"

# The scenarios whose time swings with the machine's load, and AddressSanitizer (tests/conftest.py LONG_TIER): 20-30 minutes.
test-long: $(STAMP)
	$(PYTEST) -m long

# The benchmark commands whose quickest form takes minutes (tests/conftest.py BENCHMARK_TIER).
test-benchmarks: $(STAMP)
	$(PYTEST) -m benchmarks

serve: $(STAMP)
	$(BIN)/python -m service

# make loadtest: 60 s of the traffic mix (loadtests/locustfile.py) against a running `make serve`;
# CSV and HTML report in loadtests/results/. Exits 1 on any failure or a breached threshold.
LOADTEST_HOST ?= http://127.0.0.1:8000
.PHONY: loadtest
loadtest: $(STAMP)
	mkdir -p loadtests/results
	$(BIN)/python -m locust -f loadtests/locustfile.py --headless -u 8 -r 2 -t 60s --host $(LOADTEST_HOST) \
		--csv loadtests/results/run --html loadtests/results/report.html --exit-code-on-error 1 --only-summary

# make monitor: Prometheus on 127.0.0.1:9090 scraping the local service's metrics (127.0.0.1:8080)
# with the alerts of deploy/prometheus/alerts.yml; Grafana's provisioning is in deploy/grafana.
.PHONY: monitor
monitor:
	promtool check config deploy/prometheus/prometheus.yml
	prometheus --config.file=deploy/prometheus/prometheus.yml --web.listen-address=127.0.0.1:9090 --storage.tsdb.path=.prometheus-data
