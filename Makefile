# dagfold: `make run` (the local stack on the embedded log) and `make test` (every test).
# Both install what they need into .venv first; Kafka jars are cached in .cache/.

PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed-stamp
DATA    ?= .dagfold
PORT    ?= 8080
KAFKA_PORT ?= 9092
BROKERS ?= 1
PYTEST_ARGS ?=
# make test runs on 3 pytest-xdist workers, a test file at a time, the longest files first (each worker starts
# its own broker, S3 server and `dagfold up`; tests/conftest.py orders the files): 11 min 13 s of tests on
# 2 cores (fresh clone of e279f43, 744 collected) against about 19 min in one process. Its summary
# says 712 passed: under xdist schemathesis's 34 operations report under 2 node IDs (all 34 run; `-v` lists
# each PASSED), so 744 - 32. `make test PYTEST_XDIST=` runs it in one process (as
# DAGFOLD_TEST_KAFKA, one broker for every test, requires).
PYTEST_XDIST ?= -n 3 --dist loadfile --no-loadscope-reorder

.PHONY: install run test systemd-tools soak kafka-up kafka-down kafka-fetch s3-fetch jaeger-fetch jaeger-up jaeger-down trace-screenshots browser screenshots bench bench-peers bench-scale bench-hostile bench-kafka-runs bench-gpu-sweep bench-gpu-fleet chaos lint clean

install: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test,dev]'
	@touch $(STAMP)

# The examples run shell tasks and GPU jobs. As root they would run as root, which dagfold refuses unless
# told: TASK_FLAGS says so (a developer's own machine); TASK_FLAGS='--task-user nobody' runs them as nobody.
TASK_FLAGS ?= --allow-root-tasks

run: install
	$(BIN)/dagfold up --examples --handlers noop,sleep,shell --gpu-nodes 2 --data $(DATA) --port $(PORT) $(TASK_FLAGS)

kafka-fetch:
	deploy/kafka/kafka.sh fetch

# Jaeger all-in-one (tests/test_tracing_jaeger.py, `make jaeger-up` to look at traces): built once with the
# Go toolchain into .cache/jaeger/<version>/ (several minutes on 2 cores)
jaeger-fetch:
	deploy/jaeger/jaeger.sh fetch

jaeger-up: jaeger-fetch
	deploy/jaeger/jaeger.sh start

jaeger-down:
	deploy/jaeger/jaeger.sh stop

# docs/img/trace-*.png: a Montage trace and a preempted GPU job's in Jaeger's UI (needs .cache/jaeger/ui-v1.76.0)
trace-screenshots: install jaeger-fetch browser
	$(BIN)/python -m tests.trace_screenshots --out docs/img --ui-assets .cache/jaeger/ui-v1.76.0

# S3Proxy (S3-compatible object storage for the artifact tests), fetched once into .cache/m2
s3-fetch:
	deploy/s3proxy/s3proxy.sh fetch

# Debian's Chromium for the dashboard browser test (Playwright only drives it; no `playwright install`).
browser:
	@command -v chromium >/dev/null 2>&1 || { SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update && $$SUDO apt-get install -y chromium; }

# Every dashboard view, as docs/operations.md shows it, into docs/img (about two minutes)
screenshots: install browser
	$(BIN)/python -m tests.screenshots --out docs/img

# systemd-analyze for tests/test_systemd_units.py (checks deploy/systemd without a running systemd)
systemd-tools:
	@command -v systemd-analyze >/dev/null 2>&1 || { SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update && $$SUDO apt-get install -y systemd; }

test: install kafka-fetch s3-fetch jaeger-fetch browser systemd-tools
	$(BIN)/pytest $(PYTEST_XDIST) $(PYTEST_ARGS)

kafka-up: kafka-fetch
	KAFKA_PORT=$(KAFKA_PORT) KAFKA_BROKERS=$(BROKERS) deploy/kafka/kafka.sh start

kafka-down:
	KAFKA_PORT=$(KAFKA_PORT) KAFKA_BROKERS=$(BROKERS) deploy/kafka/kafka.sh stop

bench: install kafka-fetch
	$(BIN)/python -m bench.run
	$(BIN)/python -m bench.recovery

# Dask, Celery, Prefect and Temporal side by side (installed into .cache/peers-venv, never into .venv)
bench-peers: install kafka-fetch
	bench/peers/setup.sh
	$(BIN)/python -m bench.peers
	$(BIN)/python -m bench.peers.durations --repeat 3

# Synthetic layered DAGs of 1k to 1M tasks on the embedded stack (about 10 minutes; 6 GiB at 1M)
bench-scale: install
	$(BIN)/python -m bench.scale

# The soak: the job mix of bench/soak.py (DAGs of 1-2,000 tasks, GPU jobs, cancels, retries, callbacks) against
# `dagfold up` for SOAK_MINUTES; RSS, disk and API p99 every 10 s into bench/results/soak.json and docs/img/soak.png
SOAK_MINUTES ?= 60
soak: install
	$(BIN)/python -m bench.soak --minutes $(SOAK_MINUTES)

# Hostile input against a live `dagfold up`: answers, crash, peak RSS growth, callbacks, framing, task outputs,
# forged grants, lying runtimes (bench/results/hostile_api.json)
bench-hostile: install
	$(BIN)/python -m bench.hostile_api

# The synthetic GPU day at 70/85/95/110% offered load, ours beside FIFO and best-fit (SWEEP_GPUS=10000 for the full day)
SWEEP_GPUS ?= 1000
bench-gpu-sweep: install
	$(BIN)/python -m dagfold sim day --gpus $(SWEEP_GPUS) --sweep 0.7,0.85,0.95,1.1 --out bench/results/gpu-day-sweep.json

# The deployed GPU path at 10,000 GPUs: 1,250 simulated 8-GPU hosts over Kafka driving the real allocator and
# scheduler (bench/results/gpu-fleet.json; needs a quiet machine: about FLEET_SECONDS + 3 minutes, at most 20)
FLEET_HOSTS ?= 1250
FLEET_SECONDS ?= 120
bench-gpu-fleet: install kafka-fetch
	timeout -s INT -k 60 1200 $(BIN)/python -m bench.fleet --hosts $(FLEET_HOSTS) --seconds $(FLEET_SECONDS)

# dagfold run --log kafka://... 50 times in a row on one broker: time and RSS per run (about 8 minutes)
bench-kafka-runs: install kafka-fetch
	$(BIN)/python -m bench.kafka_runs --runs 50

# The long chaos run: >= 3,000 faults on a 3-broker cluster, >= 300 of each network partition kind (root: network
# namespaces); the short run is part of `make test`
chaos: install kafka-fetch
	$(BIN)/python -m chaos --profile long

lint: install
	$(BIN)/ruff check dagfold services projections tests bench examples chaos
	$(BIN)/mypy dagfold  # services/ and projections/ through their links dagfold/services, dagfold/projections

clean:
	rm -rf $(DATA) .pytest_cache
