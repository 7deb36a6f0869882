# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
# Each creates or refreshes .venv by itself (Python 3.12, as .python-version says).

PYTHON ?= python3.12
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
# The Megatron-Bridge release whose own save writes the Bridge fixtures (pyproject's bridge extra).
BRIDGE_VERSION := 0.6.2

.PHONY: venv sshd slurm slurm-down postgres chromium b3sum lint test test-quick demo demo-up demo-down screenshots bench clean

venv: $(STAMP)

# Rebuilt when pyproject.toml changes or the venv is not a 3.12 one.
$(STAMP): pyproject.toml
	@if ! $(BIN)/python -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then \
		rm -rf $(VENV) && $(PYTHON) -m venv $(VENV); fi
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test,bridge]'
	$(BIN)/python -m pip install --quiet --no-deps megatron-bridge==$(BRIDGE_VERSION)
	@touch $(STAMP)

# The node-health tests start real OpenSSH servers on 127.0.0.x: they need sshd.
sshd:
	@test -x /usr/sbin/sshd || { command -v apt-get >/dev/null && apt-get install -y -q openssh-server >/dev/null; } \
		|| { echo "make: the tests need OpenSSH's sshd (Debian: apt-get install openssh-server)"; exit 2; }

# A real Slurm cluster on this machine (slurmctld, three slurmd as nodes n1-n3, munge), installed
# from Debian's packages if missing; state in data/slurm. The drill and drain tests use it.
slurm:
	@infra/slurm/local_cluster.sh up

slurm-down:
	@infra/slurm/local_cluster.sh down

# The production test runs a private PostgreSQL 15 cluster from Debian's package.
postgres:
	@test -x /usr/lib/postgresql/15/bin/initdb || { command -v apt-get >/dev/null \
		&& DEBIAN_FRONTEND=noninteractive apt-get install -y -q postgresql >/dev/null; } \
		|| { echo "make: the tests need PostgreSQL 15 (Debian: apt-get install postgresql)"; exit 2; }

# The UI test looks at the Prefect UI in headless Chromium (Debian's package).
chromium:
	@command -v chromium >/dev/null || { command -v apt-get >/dev/null \
		&& DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium >/dev/null; } \
		|| { echo "make: the UI test needs Chromium (Debian: apt-get install chromium)"; exit 2; }

# The linter first: it costs seconds, the suite minutes. Then the house rules ruff has no rule
# for: no import cycle between the packages of tasks/, no function over 80 lines.
lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python infra/lint/import_cycles.py
	$(BIN)/python infra/lint/long_functions.py

# Four xdist workers on CI's two cores: many end-to-end tests wait (Prefect's heartbeat and
# triggers, a worker's poll, a collective's timeout, Slurm's progress watch), and with three the
# waits of the longest tests fell together (/proc/stat: 23-60% busy for half a minute); a fourth
# keeps both cores busy (95-100%). Measured 2026-12-07 in the checkout: 424.3 s with four, 457.6
# and 487.5 s with three; peak memory 8 GB of 24. The tests that share the Slurm cluster or a
# module's fixture run on one worker (tests/conftest.py, xdist_group); the others wherever one
# is free.
PARALLEL ?= -n 4 --dist loadgroup

# The Slurm cluster make started is stopped after the tests, whatever they found.
test: venv sshd slurm postgres chromium lint
	$(BIN)/python -m pytest $(PARALLEL); status=$$?; infra/slurm/local_cluster.sh down; exit $$status

# The inner loop: no training, no servers, no cluster (the tests not marked slow).
test-quick: venv lint
	$(BIN)/python -m pytest -m "not slow" $(PARALLEL)

demo: venv
	$(BIN)/python -m infra.demo

# The README's screenshots of the Prefect UI, taken in headless Chromium from the demo's server
# (the same pages and checks as the browser test).
screenshots: demo chromium
	$(BIN)/python -m tests.helpers.ui http://127.0.0.1:4200/api docs/images

# Only the services make demo starts (server, deployments, worker, watchdog), without the story.
demo-up: venv
	$(BIN)/python -m infra.demo up

# Stops the Prefect server and the worker that make demo left running.
demo-down: venv
	$(BIN)/python -m infra.demo down

# The bench's reference column hashes with b3sum (Debian's package).
b3sum:
	@command -v b3sum >/dev/null || { command -v apt-get >/dev/null \
		&& DEBIAN_FRONTEND=noninteractive apt-get install -y -q b3sum >/dev/null; } \
		|| { echo "make: the bench needs b3sum (Debian: apt-get install b3sum)"; exit 2; }

bench: venv sshd slurm b3sum
	$(BIN)/python -m tests.bench.bench_verify
	$(BIN)/python -m tests.bench.bench_scale
	SLURM_CONF=$(CURDIR)/data/slurm/slurm.conf $(BIN)/python -m tests.bench.bench_verify_slurm
	$(BIN)/python -m tests.bench.bench_drill
	$(BIN)/python -m tests.bench.bench_health
	$(BIN)/python -m tests.bench.bench_resume

clean:
	rm -rf $(VENV) data/bench
