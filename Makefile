# The two commands of the README: `make serve` and `make test`. Everything installs through here.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch comes from the machine's CPU wheel (pip's find-links); pinning it keeps pip from fetching a CUDA build.
TORCH := torch==2.13.0
ARGS ?=
# The suite in four phases. First, two at a time: the real-time tests (calls, listening, the Ray
# cluster) in one process at normal priority, and beside it, at the lowest CPU priority (SCHED_IDLE: it
# runs only on a core nothing else wants; nice 19 where that policy is refused), the model tests
# (CPU-bound, no clocks: parity, batching, exports) and the servers without clocks (below) in one
# session on two pytest-xdist workers, a module per worker at a time (the longest modules first:
# NICED_FIRST), one torch thread each (tests/conftest.py). The real-time process uses ~0.6 of the 2
# cores on average; the idle-priority phase takes only what it leaves and has no clocks to miss. Last, once both are done, alone: the tests that bound a
# latency a listener hears (LATENCY_TESTS: browsers, barge-in, loopback calls). The background output
# is printed when it ends (.test-logs/background.log). `make test ARGS="tests/test_call.py -x"` runs
# just that.
PARALLEL_TESTS := $(filter-out tests/test_cv2_loopback.py tests/test_cv2_text_prep.py,$(wildcard tests/test_cv2_*.py)) \
	$(wildcard tests/test_cv3_*.py tests/test_export_*.py tests/test_gpu*.py) tests/test_doctor.py \
	tests/test_import_graph.py tests/test_speak_request.py tests/test_delivery.py tests/test_schedule.py \
	tests/test_scheduler.py tests/test_scheduler_batches.py tests/test_validation_properties.py \
	tests/test_voice_ids.py tests/test_trim.py tests/test_text_chunks.py tests/test_resampler.py \
	tests/test_audio_level.py tests/test_opus_send.py tests/test_listen_vad_skip.py \
	tests/test_listen_pcm_hops.py tests/test_bf16_rotary.py tests/test_draw_one.py tests/test_static_steps.py \
	tests/test_step_budget.py tests/test_bf16_euler.py tests/test_dtx_schedule.py tests/test_track_dtx.py \
	tests/test_grouped_attention.py tests/test_slot_kv_fused.py tests/test_flow_context_bytes.py \
	tests/test_flow_qkv.py tests/test_flow_step_inputs.py tests/test_flow_saved_states.py tests/test_flow_kv_rows.py \
	tests/test_error_guard.py
# Servers without clocks (schemas, config, voices): with the model tests, beside nothing that measures
# playback. The Ray modules stay serial: a client joins the newest cluster on the host
# (`address = "auto"`), so two Ray modules at once would cross their clusters.
SERVER_TESTS := tests/test_config.py \
	tests/test_container.py tests/test_cors.py tests/test_turn.py tests/test_voice_api.py \
	tests/test_voice_owners.py tests/test_voice_decode_bounds.py tests/test_api_tokens.py \
	tests/test_api_bad_input.py tests/test_call_info_schema.py tests/test_speak_options.py \
	tests/test_batch_metrics.py tests/test_step_metrics.py tests/test_stream_sink.py tests/test_readyz.py \
	tests/test_remote_config.py tests/test_engine_commands.py tests/test_embed_voices.py \
	tests/test_listen_config.py
# The idle-priority session's longest modules (20-35 s each on this VM), handed out first so that no
# worker ends the phase alone with one of them.
NICED_FIRST := tests/test_voice_api.py tests/test_cv2_flow_incremental.py tests/test_cv2_engine.py \
	tests/test_cv2_accel_engine.py tests/test_cv2_flow_compiled.py tests/test_export_vllm.py \
	tests/test_cv3_bistream_api.py tests/test_cv2_voice_prompt_parts.py
NICED_TESTS := $(NICED_FIRST) $(filter-out $(NICED_FIRST),$(PARALLEL_TESTS) $(SERVER_TESTS))
# The real-time tests that bound a latency a listener hears (browsers, barge-in, loopback calls), and
# the Ray cluster restart under a live call (it once missed its 20 s bound beside the model phase): the
# last phase, with nothing beside them.
LATENCY_TESTS := tests/test_ray_restart.py tests/test_api.py tests/test_call.py tests/test_call_vanish.py tests/test_loopback.py \
	tests/test_cv2_loopback.py $(wildcard tests/test_browser*.py) tests/test_listen_browser.py \
	tests/test_listen_loopback.py tests/test_listen_bargein.py tests/test_listen_heard_text.py \
	tests/test_listen_inbound.py
# Everything else runs in the real-time phase at normal priority, e.g. tests/test_engine_command_parts.py:
# command slices are wall-clock time, and at idle priority beside that phase quick parts shared fewer.
SERIAL_TESTS := $(filter-out $(PARALLEL_TESTS) $(SERVER_TESTS) $(LATENCY_TESTS),$(wildcard tests/test_*.py))
PYTEST = HF_HUB_OFFLINE=1 $(OFFLINE) $(BIN)/python -m pytest -q
IDLE := $(shell chrt --idle 0 true >/dev/null 2>&1 && echo chrt --idle 0)
NICE_PYTEST = HF_HUB_OFFLINE=1 $(IDLE) nice -n 19 $(OFFLINE) $(BIN)/python -m pytest -q
# As root (CI), the suite runs in a network namespace with no way out (tests/offline_netns.sh), which
# proves the server, the browser test and the bundled models need nothing beyond loopback.
# The niced session's own temporary root (pytest keeps only its 3 newest default ones: never another's).
TMP_BG := /tmp/voicertc-test-$(shell id -u)
OFFLINE := $(shell tests/offline_netns.sh true >/dev/null 2>&1 && echo tests/offline_netns.sh)

.PHONY: serve test install install-dev chromium coturn lint typecheck bench clean

serve: install
	$(BIN)/voicertc serve $(ARGS)

# The static checks first (mypy on the package, ruff on everything): CI runs exactly this target.
test: install-dev chromium coturn typecheck lint
ifeq ($(strip $(ARGS)),)
	@mkdir -p .test-logs $(TMP_BG)
	@$(NICE_PYTEST) -n 2 --dist loadscope --durations=15 --basetemp=$(TMP_BG)/niced $(NICED_TESTS) \
	   >.test-logs/background.log 2>&1 & background=$$!; \
	 $(PYTEST) --durations=20 $(SERIAL_TESTS); realtime=$$?; \
	 wait $$background; niced=$$?; \
	 echo "=== the model and server tests (idle priority, beside the real-time phase) ==="; \
	 cat .test-logs/background.log; \
	 echo "=== the latency-bounding tests, alone ==="; \
	 $(PYTEST) --durations=10 $(LATENCY_TESTS); latency=$$?; \
	 echo "=== exits: real-time $$realtime, model and server $$niced, latency-bounding $$latency ==="; \
	 test $$realtime = 0 && test $$niced = 0 && test $$latency = 0
else
	$(PYTEST) $(ARGS)
endif

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
	rm -rf $(VENV) .pytest_cache .test-logs
