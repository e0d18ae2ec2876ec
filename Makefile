# The two commands of the README: `make serve` and `make test`. Everything installs through here.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch comes from the machine's CPU wheel (pip's find-links); pinning it keeps pip from fetching a CUDA build.
TORCH := torch==2.13.0
ARGS ?=
# Two pytest workers (pytest-xdist), a test module per worker at a time (module fixtures built once):
# most of the suite waits on real time (calls play at real-time pace, browsers, Whisper). PYTEST_WORKERS=
# (empty) runs it in one process.
PYTEST_WORKERS ?= -n 2 --dist loadscope
# As root (CI), the suite runs in a network namespace with no way out (tests/offline_netns.sh), which
# proves the server, the browser test and the bundled models need nothing beyond loopback.
OFFLINE := $(shell tests/offline_netns.sh true >/dev/null 2>&1 && echo tests/offline_netns.sh)

.PHONY: serve test install install-dev chromium coturn lint typecheck bench clean

serve: install
	$(BIN)/voicertc serve $(ARGS)

# The static checks first (mypy on the package, ruff on everything): CI runs exactly this target.
test: install-dev chromium coturn typecheck lint
	HF_HUB_OFFLINE=1 $(OFFLINE) $(BIN)/python -m pytest -q $(PYTEST_WORKERS) $(ARGS)

install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH)
	$(BIN)/python -m pip install -q -e ".[cpu-voice,cosyvoice,listen]"
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed
	$(BIN)/python -m pip install -q -e ".[cpu-voice,cosyvoice,scale,listen,dev]"
	touch $@

# Debian's Chromium for the browser tests (never a downloaded browser).
chromium:
	@command -v chromium >/dev/null || { \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update -q && $$SUDO apt-get install -y -q chromium; }

# Debian's coturn for the TURN relay tests (tests/turn_helpers.py starts it on loopback; never as a service).
coturn:
	@command -v turnserver >/dev/null || { \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update -q && $$SUDO apt-get install -y -q coturn; }

lint: install-dev
	$(BIN)/ruff check voicertc signaling tests bench

typecheck: install-dev
	$(BIN)/mypy voicertc signaling

bench: install-dev
	$(BIN)/python -m bench.piper_latency

clean:
	rm -rf $(VENV) .pytest_cache
