# `make run`: the demo job on local Spark; `make test`: the test suite.
# Both create/refresh .venv and install the package first.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run submit test docs lint bench bench-quick bench-against-spark check-java test-tools delta-jars kafka-jars \
	cdc-stack clean-data

$(STAMP): pyproject.toml
	@$(MAKE) --no-print-directory check-java
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || \
		{ echo "error: Python 3.11+ is required (found $$($(PYTHON) --version 2>&1); the config reader uses tomllib)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet -e '.[dev]'
	@touch $(STAMP)

check-java:
	@command -v java >/dev/null 2>&1 || { \
		echo "error: Java 17+ is required by Spark and was not found on PATH."; \
		echo "       Debian/Ubuntu: apt-get install openjdk-17-jre-headless"; exit 1; }
	@v=$$(java -version 2>&1 | sed -n 's/.*version "\([0-9]*\).*/\1/p' | head -1); \
	if [ -z "$$v" ] || [ "$$v" -lt 17 ]; then \
		echo "error: Java 17+ is required by Spark; 'java -version' reports: $$(java -version 2>&1 | head -1)"; \
		exit 1; fi

# METRICS_PORT=<port> (0: off) overrides conf/sink.toml's metrics_port.
run: $(STAMP)
	$(PY) -m jobs.demo $(if $(METRICS_PORT),--metrics-port $(METRICS_PORT))

test: $(STAMP) test-tools delta-jars cdc-stack
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet
	$(PY) -m pytest -q
	@echo "the tests marked connect again, through a Spark Connect server started by the docs' recipe (a process holds one kind of session)"
	SINK_SPARK=connect $(PY) -m pytest -q

# The documentation site (docs/, mkdocs.yml) at http://127.0.0.1:8000 while it runs.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve

# The real Prometheus scrape test needs Debian's prometheus package (promtool too).
test-tools:
	@command -v prometheus >/dev/null 2>&1 || { \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
			echo "installing Debian's prometheus package for the scrape test"; \
			apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null \
			|| echo "warning: prometheus could not be installed; the scrape test will be skipped"; \
		else echo "note: prometheus is not installed (apt-get install prometheus); the scrape test will be skipped"; fi; }

# Delta's Spark jars, with their dependencies, into ~/.m2/repository (Spark's Ivy reads it as a
# local repository; Maven's own settings reach the remote one), once: the tests run delta-spark.
delta-jars: $(STAMP)
	@jar="$$($(PY) -m sink.lakehouse.engines.spark_delta --jar)"; pom="$${jar%.jar}.pom"; \
	if [ ! -f "$$jar" ] || [ ! -f "$$pom" ]; then \
		command -v mvn >/dev/null 2>&1 || { echo "error: Maven (mvn) is needed once to fetch Delta's jars:" \
			"apt-get install maven, then: $$($(PY) -m sink.lakehouse.engines.spark_delta --fetch-command)"; exit 1; }; \
		echo "fetching $$($(PY) -m sink.lakehouse.engines.spark_delta) and its dependencies into ~/.m2"; \
		$$($(PY) -m sink.lakehouse.engines.spark_delta --fetch-command); fi

# Spark's Kafka connector at the installed Spark's version into ~/.m2, as Delta's jars: the job's
# `[source] format = "kafka"` (jobs/kafka_source.py).
kafka-jars: $(STAMP)
	@if [ ! -f "$$($(PY) -m jobs.kafka_source --jar)" ]; then \
		echo "fetching $$($(PY) -m jobs.kafka_source) and its dependencies into ~/.m2"; \
		$$($(PY) -m jobs.kafka_source --fetch-command); fi

# What the Kafka tests start (tests/cdc_stack): the classpaths of a Kafka broker and of a Kafka
# Connect worker with Debezium's PostgreSQL connector (resolved by Maven into ~/.m2), Spark's
# Kafka connector, and Debian's PostgreSQL server.
CDC_STACK := $(VENV)/cdc-stack
cdc-stack: kafka-jars $(CDC_STACK)/broker.classpath $(CDC_STACK)/connect.classpath
	@ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || { \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
			echo "installing Debian's postgresql package for the Kafka tests"; \
			apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null; \
		else echo "error: the Kafka tests need PostgreSQL's server: apt-get install postgresql"; exit 1; fi; }

$(CDC_STACK)/%.classpath: tests/cdc_stack/%/pom.xml $(STAMP)
	@mkdir -p $(CDC_STACK)
	@echo "resolving $< into ~/.m2"
	mvn -q -f $< dependency:build-classpath -Dmdep.outputFile=$(abspath $@)

# The ready job under the venv's spark-submit (the pip pyspark needs SPARK_HOME, and the
# driver must run the venv's Python), on conf/sink.toml: what is in the landing dir, then stop.
# Under Delta's Spark engine: its package, extension and catalog passed as a cluster takes them.
submit: $(STAMP) delta-jars
	SPARK_HOME="$$($(PY) -c 'import os, pyspark; print(os.path.dirname(pyspark.__file__))')" \
	PYSPARK_PYTHON="$(CURDIR)/$(PY)" PYSPARK_DRIVER_PYTHON="$(CURDIR)/$(PY)" \
		$(VENV)/bin/spark-submit --master "local[2]" $$($(PY) -m sink.lakehouse.engines.spark_delta --submit-args) \
		jobs/upsert_stream.py --config conf/sink.toml --once --engine delta-spark

# Benchmarks (not tests): results in bench/results/<name>-<date>.json and .png.
bench: $(STAMP) delta-jars cdc-stack
	$(PY) -m bench.run
	$(PY) -m bench.run --kafka --keys 1000000

bench-quick: $(STAMP) delta-jars
	$(PY) -m bench.run --quick

# The sink against delta-spark's MERGE alone, at 10M rows (30 minutes on 2 cores).
bench-against-spark: $(STAMP) delta-jars
	$(PY) -m bench.run --against-spark --sizes 10000000 --batches 3

lint: $(STAMP)
	$(VENV)/bin/ruff check sink jobs tests bench docs

clean-data:
	rm -rf data/demo
