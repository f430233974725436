# The two commands the README promises: `make demo` and `make test`. Both run as root on a fresh
# Debian 12 machine and install what they need first.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
APT_PACKAGES := nginx-light iperf3 aria2 rsync curl openssl iproute2 python3-venv python3-pip \
	python3-pyroute2 python3-apscheduler python3-yaml python3-requests python3-sdnotify \
	python3-prometheus-client python3-pytest python3-pytest-timeout python3-numpy python3-pyfuse3 \
	python3-trio fuse3 libfuse3-dev pkg-config gcc python3-dev python3-botocore faketime
DEB_BUILD_PACKAGES := debhelper dh-python pybuild-plugin-pyproject python3-all python3-setuptools \
	lintian systemd fakeroot build-essential man-db

.PHONY: test demo bench deps venv lint deb clean

deps: .deps-stamp
.deps-stamp:
	@missing=""; for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
		echo "installing:$$missing"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing; \
	fi
	@systemctl disable --now nginx >/dev/null 2>&1 || true  # the testbed runs its own nginx per host
	@touch $@

venv: $(VENV)/.stamp
$(VENV)/.stamp: pyproject.toml .deps-stamp
	/usr/bin/python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	@touch $@

lint: venv
	$(VENV)/bin/ruff check .

# The whole suite: lint, unit and integration tests (venv, newest PyPI releases), the unit tests
# and the integration tests marked `debian` again under Debian's python3 and packaged libraries
# (APScheduler 3.9.1, prometheus-client 0.16, requests 2.28, ...), then the Debian package built,
# installed, tested as installed and purged.
test: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/pytest -q
	PYTHONPATH=$(CURDIR) /usr/bin/python3 -m pytest -q -p no:cacheprovider tests/unit
	PYTHONPATH=$(CURDIR) /usr/bin/python3 -m pytest -q -p no:cacheprovider -m debian tests/integration
	$(MAKE) deb-check

bench: venv
	@for b in tests/bench/[a-z]*.py; do echo "== $$b"; PYTHONPATH=$(CURDIR) $(PY) $$b || exit 1; done

demo: venv
	$(PY) -m tests.demo

clean:
	rm -rf $(VENV) .deps-stamp build *.egg-info .pytest_cache .ruff_cache

# The Debian package (packaging/deb): built from a copy of the tree with Debian's python3 only,
# into build/deb/; `deb-check` is its CI acceptance (installs, tests and purges it: root, CI box).
deb:
	@missing=""; for p in $(DEB_BUILD_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
		echo "installing:$$missing"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing; \
	fi
	packaging/build-deb.sh

.PHONY: deb-check
deb-check: deps deb
	@dpkg -s systemd-container >/dev/null 2>&1 || { apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends systemd-container; }
	packaging/check-deb.sh
