#!/bin/bash
# The GPU benchmark run (issue 20), prepared for a lent GPU machine that reaches no package registry:
# one script, at most ~8 minutes on an H100, every step under its own `timeout` and a global deadline,
# each step's JSON and log packed into ONE archive in the output folder as soon as the step ends.
#
#   bench/gpu_suite.sh prepare              # here, with PyPI: wheels into .whl/, golden + peer into .carry/
#   bench/gpu_suite.sh [OUT_DIR]            # there (run from the checkout root; OUT_DIR or $OUT)
#   DEV=cpu bench/gpu_suite.sh /tmp/suite   # the dry run: same steps, tiny directory, small sizes
#
# Steps: (1) the model directory (full-size random weights, `bench.make_full_model_dir`; DEV=cpu: the
# tiny one), (2) `pytest -m gpu tests/test_gpu*.py`, (3) `bench.cv2_stream` (bfloat16 + CUDA graphs,
# TTFA only), (3b) `bench.gpu_probe` (decode steps by rows, chunks captured vs eager, profiler tables),
# (3c) `bench.gpu_flow_probe` (first flow chunks of N utterances: encoder vs Euler steps; v3: its DiT chunks),
# (4) `bench.cv2_load --concurrency 1 8 16` (bfloat16 + CUDA graphs), (5)/(6) `bench.peer_official` in
# float32 and in bfloat16 (the official side: its fp16 path), (7) `bench.cv2_load --concurrency 32 64`,
# then the compiled static steps (`[engine] compile` with `cuda_graphs`; minutes of compiling each, so
# last and only when named in STEPS): pytest_gpu_compiled (the GPU tests of compiled steps; pytest_gpu
# leaves them out), step_kernels (`bench.step_kernels`: kernels per static step, eager vs compiled),
# decode_compiled (`bench.cv2_llm_batch --graphs`, eager kernels
# then compiled, rows 1 16 32), decode_ahead (the same uncompiled, read at once vs launched ahead),
# cv2_load_profiled (the largest LEVELS_SMALL level under torch.profiler),
# cv2_stream_stepped / cv2_load_stepped (`--no-decode-ahead`: every decode
# step read before the next is launched, the path before `llm.ahead`), cv2_load_llm_thread (LEVELS_SMALL
# with `--llm thread`: the LLM on its own thread, decode graphs and stream), cv2_stream_compiled,
# cv2_load_compiled (LEVELS_SMALL), cv2_load_expandable (cv2_load with
# PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True).
# cv2_load writes its JSON only at its end, so its levels are split in two steps and the large ones go
# last: a timeout there loses only them. A step that would start past the deadline is skipped; a step
# that fails does not stop the next one.
#
# Output, in OUT: `suite.log` (everything, tee'd) and `results.tar.gz`, rewritten after every step:
# `steps.tsv` (step, exit status, seconds), `<step>.log`, `<step>/`: the JSON the step wrote into
# bench/results (peer_*: the side-by-side JSON, the official JSON and logs; the .pt dumps only with
# KEEP_DUMPS=1), `pytest_gpu.xml`. Exit status: the number of failed steps.
#
# Environment (nothing outside the checkout is read except what these name):
#   OUT              output folder (when no argument is given)
#   DEV              cuda (default) | cpu (dry run)
#   PYTHON           interpreter (default: python3)
#   DEADLINE_S       global budget in seconds from the start (default: 330 on cuda: the machine's start-up
#                    counts against the same device time; 1500 on cpu)
#   WHEELS           wheel folder installed offline into SITE first (default: .whl; skipped when absent;
#                    DEV=cpu: WHEELS_CPU, default none, since .whl holds the GPU machine's Python 3.12 wheels)
#   SITE             scratch `pip --target` folder for WHEELS, put first on PYTHONPATH (default: /tmp/voicertc-site)
#   PEER_SITE        extra packages of the official code (default: SITE; DEV=cpu: /work/.peer-site); `--site`
#   PEER_DIR         the peer tree (default: .carry/peer when present, else ../shared/peer)
#   VOICERTC_GOLDEN  the golden copy for the tests (default: .carry/golden when present, else ../shared/golden)
#   MODEL_DIR        where the model directory is built (default: .models/cv2_full; cpu: .models/cv2_tiny_suite)
#   WORK             scratch folder for the steps' files (default: a fresh mktemp -d)
#   KEEP_DUMPS       1: also pack the peer bench's .pt dumps (mels + PCM of both sides; a few MB)
#   STEPS            only these steps (names as in steps.tsv, space-separated; default: all): a lease split
#                    in two calls runs half each, e.g. STEPS="model_dir pytest_gpu cv2_stream cv2_load"
#   LEVELS_SMALL, LEVELS_LARGE  cv2_load's concurrency levels of its two steps (default 1 8 16 / 32 64)
#   PYTEST_K         pytest_gpu's `-k` (default "not compiled": ~4 minutes), e.g. "ahead" (the decode-ahead
#                    equality on CUDA, seconds) in a short call
#   PEER_FLOOR       0: v3's peer step skips the official side's second process (its run-to-run floor)
#   PEER_TOKENS, PEER_RUNS  bench.peer_official's utterance lengths and runs on cuda (default "250 750", 2;
#                    each official process costs ~25-30 s on an H100 before its first chunk)
#   SUITE            v2 (default) | v3: CosyVoice3 instead (issue 21): its full-size directory, the GPU tests,
#                    `bench.cv3_stream` (incremental vs re-run per chunk), cv3_ttfa (`bench.cv2_stream --version 3`:
#                    the TTFA parts through the backend), `bench.cv2_load --version 3`
#                    1/8/16 then 32/64 (cv3_load_matmul: 1/8/16 with `--dit-conv matmul`), `bench.peer_official --version 3` float32 (the official
#                    `CosyVoice3Model` loop); MODEL_DIR default .models/cv3_full (cpu: .models/cv3_tiny_suite)
#
# Measured on an H100 (2026-11-27): a call's start ~30 s; model_dir 15-18 s; pytest_gpu > 150 s (14 tests: 12 in 150 s);
# cv2_stream 25 s; cv2_load 1/16/32 82 s; each official process 25-30 s before its first chunk
# (peer_bfloat16 at 250 tokens, 2 runs, no floor: 53 s). A 15-minute lease fits two calls, e.g.
#   STEPS="model_dir pytest_gpu cv2_stream flow_probe cv2_load" LEVELS_SMALL="1 8 16 32" DEADLINE_S=330
#   then STEPS="model_dir peer_float32 peer_bfloat16" PEER_TOKENS="250 750" PEER_RUNS=1 and SUITE=v3
#   STEPS="model_dir cv3_load cv3_stream peer_v3 flow_probe_v3" PEER_FLOOR=0 in the same second call.
set -u
cd "$(dirname "$0")/.." || exit 1
ROOT=$PWD

if [ "${1:-}" = prepare ]; then  # on a machine with PyPI and ../shared beside the checkout
    set -e
    ../shared/gpu/fetch_wheels.sh .whl peer
    # the official CosyVoice3 code's extras (`bench.peer_official --version 3`)
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl \
        x-transformers==2.11.24 einx==0.4.3 frozendict==2.5.1 loguru==0.7.3  # loguru: x-transformers needs it
    mkdir -p .carry
    rm -rf .carry/golden .carry/peer
    cp -r ../shared/peer .carry/peer
    mkdir .carry/golden && (cd ../shared/golden && tar -cf - --exclude=./cv3 .) | (cd .carry/golden && tar -xf -)
    # of cv3/ only what the tiny CosyVoice3 directory is built from (the GPU tests speak it), not the
    # reference vectors (13 MB)
    mkdir .carry/golden/cv3 && (cd ../shared/golden/cv3 && tar -cf - --exclude='./flow_nonstream.safetensors' \
        --exclude='./hift_*.safetensors' --exclude='./llm_tiny.safetensors' --exclude='./mel_v3.safetensors' .) \
        | (cd .carry/golden/cv3 && tar -xf -)
    du -shc .whl .carry
    echo "carry: .whl .carry (64 MiB at most in all)"
    exit 0
fi

LEVELS_SMALL_ENV=${LEVELS_SMALL:-} LEVELS_LARGE_ENV=${LEVELS_LARGE:-}  # read before the defaults below
OUT=${1:-${OUT:?usage: bench/gpu_suite.sh OUT_DIR (or set OUT); see the top of this file}}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
DEV=${DEV:-cuda}
PYTHON=${PYTHON:-python3}
WHEELS=${WHEELS-.whl}  # DEV=cpu: none unless set (.whl holds the GPU machine's Python 3.12 wheels)
[ "$DEV" = cpu ] && WHEELS=${WHEELS_CPU:-}
SITE=${SITE:-/tmp/voicertc-site}
if [ "$DEV" = cpu ]; then PEER_SITE=${PEER_SITE:-/work/.peer-site}; else PEER_SITE=${PEER_SITE:-$SITE}; fi
WORK=${WORK:-$(mktemp -d)}
mkdir -p "$WORK/pack"
PACK=$WORK/pack
if [ -z "${PEER_DIR:-}" ]; then
    if [ -d .carry/peer ]; then PEER_DIR=$ROOT/.carry/peer; else PEER_DIR=$ROOT/../shared/peer; fi
fi
if [ -z "${VOICERTC_GOLDEN:-}" ]; then
    if [ -d .carry/golden ]; then VOICERTC_GOLDEN=$ROOT/.carry/golden; else VOICERTC_GOLDEN=$ROOT/../shared/golden; fi
fi
export VOICERTC_GOLDEN HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1

if [ "$DEV" = cpu ]; then
    DEADLINE_S=${DEADLINE_S:-1500}
    MODEL_DIR=${MODEL_DIR:-$ROOT/.models/cv2_tiny_suite}
    MAKE_DIR=(bench.make_tiny_model_dir "$MODEL_DIR")
    STREAM=(--device cpu --dtype float32 --chunks 0 --runs 1)
    PROBE=(--device cpu --dtype float32 --runs 1 --rows 1 2)
    LOAD=(--device cpu --dtype float32 --max-tokens 40 --timeout-s 300)
    LEVELS_SMALL=(1 2) LEVELS_LARGE=(3)
    PEER_FP32=(--device cpu --dtype float32 --tokens 100 --runs 2)
    PEER_HALF=(--device cpu --dtype bfloat16 --tokens 30 --runs 1 --no-official-floor --cuda-graphs)
    DECODE=(--device cpu --dtype float32 --graphs --batch 1 2 --steps 5 --warmup 1)
    KERNEL_ROWS=(2)
    # seconds each step may take at most (the global deadline cuts them shorter)
    T_DIR=300 T_TEST=300 T_STREAM=300 T_PROBE=400 T_LOAD=400 T_PEER32=600 T_PEER16=600 T_LOAD_LARGE=400
    T_COMPILED=400
else
    DEADLINE_S=${DEADLINE_S:-330}
    MODEL_DIR=${MODEL_DIR:-$ROOT/.models/cv2_full}
    MAKE_DIR=(bench.make_full_model_dir --out "$MODEL_DIR")
    STREAM=(--device cuda --dtype bfloat16 --cuda-graphs --chunks 0 --runs 5)
    PROBE=(--device cuda --dtype bfloat16 --runs 3 --rows 1 16)
    LOAD=(--device cuda --dtype bfloat16 --cuda-graphs --max-tokens 250 --timeout-s 100)
    LEVELS_SMALL=(1 8 16) LEVELS_LARGE=(32 64)
    # shellcheck disable=SC2206  # PEER_TOKENS: space-separated
    PEER_T=(${PEER_TOKENS:-250 750}) PEER_R=${PEER_RUNS:-2}
    PEER_FP32=(--device cuda --dtype float32 --tokens "${PEER_T[@]}" --runs "$PEER_R")
    PEER_HALF=(--device cuda --dtype bfloat16 --tokens "${PEER_T[@]}" --runs "$PEER_R" --no-official-floor --cuda-graphs)
    DECODE=(--device cuda --dtype bfloat16 --graphs --batch 1 16 32 --steps 30 --threads 8)
    KERNEL_ROWS=(16)
    T_COMPILED=300  # inductor: ~1 min a decode graph (1 row, 2+ rows), ~80 s the flow step (H200, 2026-11-25)
    T_DIR=60 T_TEST=240 T_STREAM=50 T_PROBE=70 T_LOAD=110 T_PEER32=130 T_PEER16=110 T_LOAD_LARGE=240
fi
# shellcheck disable=SC2206  # space-separated lists from the environment
[ -n "$LEVELS_SMALL_ENV" ] && LEVELS_SMALL=($LEVELS_SMALL_ENV)
# shellcheck disable=SC2206
[ -n "$LEVELS_LARGE_ENV" ] && LEVELS_LARGE=($LEVELS_LARGE_ENV)

SUITE=${SUITE:-v2}
if [ "$SUITE" = v3 ]; then
    if [ "$DEV" = cpu ]; then
        MODEL_DIR=${MODEL_DIR_V3:-$ROOT/.models/cv3_tiny_suite}
        MAKE_DIR=(bench.make_tiny_model_dir --version 3 "$MODEL_DIR")
        CV3_STREAM=(--device cpu --runs 1 --seconds 8 --chunks 0,1)
        PEER_V3=(--device cpu --dtype float32 --tokens 60 --runs 1 --no-official-floor --cuda-graphs)
    else
        MODEL_DIR=${MODEL_DIR_V3:-$ROOT/.models/cv3_full}
        MAKE_DIR=(bench.make_full_model_dir --version 3 --out "$MODEL_DIR")
        CV3_STREAM=(--device cuda --runs 3 --seconds 30 --chunks 0,1,4,8)
        # ours on the captured path (the DiT's Euler steps, the causal HiFT's synthesis), as the engine
        # serves with cuda_graphs: eager fp32 cost 1.2 s per 200-frame chunk on the H100 and ran out of time
        PEER_V3=(--device cuda --dtype float32 --tokens "${PEER_T[@]}" --runs "$PEER_R" --cuda-graphs)
        T_STREAM=70  # builds its own full-size flow + HiFT, then re-runs the history at 4 chunks
    fi
    LOAD_V3=("${LOAD[@]}" --version 3)
    [ "${PEER_FLOOR:-1}" = 0 ] && PEER_V3+=(--no-official-floor)
fi

START=$(date +%s)
exec > >(tee -a "$OUT/suite.log") 2>&1
echo "gpu_suite: SUITE=$SUITE DEV=$DEV OUT=$OUT WORK=$WORK DEADLINE_S=$DEADLINE_S MODEL_DIR=$MODEL_DIR"
echo "gpu_suite: PEER_DIR=$PEER_DIR PEER_SITE=$PEER_SITE VOICERTC_GOLDEN=$VOICERTC_GOLDEN"
echo "gpu_suite: commit $(git rev-parse --short HEAD 2>/dev/null || echo '?'), $(date -u +%FT%TZ)"
printf 'step\texit\tseconds\n' > "$PACK/steps.tsv"
FAILED=0

pack() {  # the archive of everything so far, replaced atomically
    cp "$OUT/suite.log" "$PACK/suite.log" 2>/dev/null
    local excl=(--exclude='*.pt')
    [ "${KEEP_DUMPS:-0}" = 1 ] && excl=()
    tar -czf "$OUT/results.tar.gz.tmp" "${excl[@]}" -C "$PACK" . && mv "$OUT/results.tar.gz.tmp" "$OUT/results.tar.gz"
}

step() {  # step NAME CAP_S COMMAND...: run under min(CAP_S, time left), log it, pack it
    local name=$1 cap=$2; shift 2
    if [ -n "${STEPS:-}" ] && [ "$name" != wheels ] && [[ " $STEPS " != *" $name "* ]]; then return; fi  # not asked for
    local left=$(( DEADLINE_S - ($(date +%s) - START) - 10 ))
    local limit=$(( cap < left ? cap : left ))
    if [ "$limit" -lt 15 ]; then
        echo "=== $name: skipped (deadline: ${left}s left)"
        printf '%s\tskipped\t0\n' "$name" >> "$PACK/steps.tsv"
        FAILED=$((FAILED + 1)); pack; return
    fi
    echo "=== $name (timeout ${limit}s): $*"
    touch "$WORK/.mark"
    local t0 rc
    t0=$(date +%s)
    timeout -k 10 "$limit" "$@" 2>&1 | tee "$PACK/$name.log"
    rc=${PIPESTATUS[0]}
    local took=$(( $(date +%s) - t0 ))
    # the JSON the step wrote into bench/results (cv2_stream, cv2_load)
    mkdir -p "$PACK/$name"
    find bench/results -maxdepth 1 -name '*.json' -newer "$WORK/.mark" -exec cp {} "$PACK/$name/" \; 2>/dev/null
    rmdir "$PACK/$name" 2>/dev/null
    [ "$rc" = 124 ] || [ "$rc" = 137 ] && echo "=== $name: TIMED OUT after ${took}s"
    echo "=== $name: exit $rc in ${took}s"
    printf '%s\t%s\t%s\n' "$name" "$rc" "$took" >> "$PACK/steps.tsv"
    [ "$rc" = 0 ] || FAILED=$((FAILED + 1))
    pack
}

finish() {  # the table of steps, the last archive, and the number of failed steps as the exit status
    echo "=== gpu_suite done in $(( $(date +%s) - START ))s, $FAILED step(s) failed or skipped:"
    column -t "$PACK/steps.tsv" 2>/dev/null || cat "$PACK/steps.tsv"
    pack
    exit "$FAILED"
}

# (0) offline wheels (voicertc's CosyVoice path + the official code's extras) into a scratch folder
if [ -n "$WHEELS" ] && ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    step wheels 60 "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$WHEELS"/*.whl
fi
export PYTHONPATH=$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}
"$PYTHON" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(),
torch.cuda.get_device_name() if torch.cuda.is_available() else '')"
[ "$DEV" = cpu ] || nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

step model_dir "$T_DIR" "$PYTHON" -m "${MAKE_DIR[@]}"
step pytest_gpu "$T_TEST" "$PYTHON" -m pytest -q -m gpu tests/test_gpu*.py -p no:cacheprovider \
    -k "${PYTEST_K:-not compiled}" --junitxml="$PACK/pytest_gpu.xml"
# the compiled steps' GPU tests (inductor compiles: minutes): only when named in STEPS
[ -n "${STEPS:-}" ] && step pytest_gpu_compiled "$T_COMPILED" "$PYTHON" -m pytest -q -m gpu tests/test_gpu*.py \
    -p no:cacheprovider -k compiled --junitxml="$PACK/pytest_gpu_compiled.xml"
if [ "$SUITE" = v3 ]; then
    step cv3_load "$T_LOAD" "$PYTHON" -m bench.cv2_load --model-dir "$MODEL_DIR" "${LOAD_V3[@]}" \
        --concurrency "${LEVELS_SMALL[@]}"
    step flow_probe_v3 "$T_PROBE" "$PYTHON" -m bench.gpu_flow_probe --v3 --device "$DEV" --out "$PACK/flow_probe_v3"
    # the same load with the DiT's position convs as batched matmuls (engine.dit_conv = matmul)
    step cv3_load_matmul "$T_LOAD" "$PYTHON" -m bench.cv2_load --model-dir "$MODEL_DIR" "${LOAD_V3[@]}" \
        --concurrency "${LEVELS_SMALL[@]}" --dit-conv matmul
    step cv3_stream "$T_STREAM" "$PYTHON" -m bench.cv3_stream "${CV3_STREAM[@]}"
    # TTFA parts through the engine's backend (prefill, decode to the first hop, flow, vocoder): issue 21's
    # 200 ms target, as cv2_stream measures v2's
    step cv3_ttfa "$T_STREAM" "$PYTHON" -m bench.cv2_stream --version 3 --model-dir "$MODEL_DIR" "${STREAM[@]}"
    step peer_v3 "$T_PEER32" "$PYTHON" -m bench.peer_official --version 3 --model-dir "$MODEL_DIR" \
        --peer "$PEER_DIR" --site "$PEER_SITE" --out "$PACK/peer_v3" "${PEER_V3[@]}"
    step cv3_load_large "$T_LOAD_LARGE" "$PYTHON" -m bench.cv2_load --model-dir "$MODEL_DIR" "${LOAD_V3[@]}" \
        --concurrency "${LEVELS_LARGE[@]}"
    finish
fi
step cv2_stream "$T_STREAM" "$PYTHON" -m bench.cv2_stream --model-dir "$MODEL_DIR" "${STREAM[@]}"
step gpu_probe "$T_PROBE" "$PYTHON" -m bench.gpu_probe --model-dir "$MODEL_DIR" --out "$PACK/gpu_probe" "${PROBE[@]}"
step flow_probe "$T_PROBE" "$PYTHON" -m bench.gpu_flow_probe --model-dir "$MODEL_DIR" --out "$PACK/flow_probe" \
    "${PROBE[@]}"
step cv2_load "$T_LOAD" "$PYTHON" -m bench.cv2_load --model-dir "$MODEL_DIR" "${LOAD[@]}" \
    --concurrency "${LEVELS_SMALL[@]}"
step peer_float32 "$T_PEER32" "$PYTHON" -m bench.peer_official --model-dir "$MODEL_DIR" --peer "$PEER_DIR" \
    --site "$PEER_SITE" --out "$PACK/peer_float32" "${PEER_FP32[@]}"
step peer_bfloat16 "$T_PEER16" "$PYTHON" -m bench.peer_official --model-dir "$MODEL_DIR" --peer "$PEER_DIR" \
    --site "$PEER_SITE" --out "$PACK/peer_bfloat16" "${PEER_HALF[@]}"
step cv2_load_large "$T_LOAD_LARGE" "$PYTHON" -m bench.cv2_load --model-dir "$MODEL_DIR" "${LOAD[@]}" \
    --concurrency "${LEVELS_LARGE[@]}"
if [ -n "${STEPS:-}" ]; then  # compiling takes minutes: only when asked for by name
    # kernels a static step launches, eager vs compiled (Triton kernels on CUDA), and the compile times
    step step_kernels "$T_COMPILED" "$PYTHON" -m bench.step_kernels --model-dir "$MODEL_DIR" --device "$DEV" \
        --rows "${KERNEL_ROWS[@]}"
    # the flow step's K/V input: made whole then copied (before) vs written into the static buffer (after)
    step flow_step_inputs 120 "$PYTHON" -m bench.flow_step_inputs --device "$DEV" --utterances 1 8 16
    step decode_compiled "$T_COMPILED" bash -c '"$0" -m bench.cv2_llm_batch --model-dir "$1" "${@:2}" &&
        "$0" -m bench.cv2_llm_batch --model-dir "$1" "${@:2}" --compile' "$PYTHON" "$MODEL_DIR" "${DECODE[@]}"
    # decode steps alone at the engine's slot capacity: each read before the next launch, then launched
    # ahead of the read (`llm.ahead`): ms a token at 1 / 16 / 32 rows, uncompiled
    step decode_ahead "$T_STREAM" bash -c '"$0" -m bench.cv2_llm_batch --model-dir "$1" "${@:2}" --capacity 2048 &&
        "$0" -m bench.cv2_llm_batch --model-dir "$1" "${@:2}" --capacity 2048 --ahead' "$PYTHON" "$MODEL_DIR" \
        "${DECODE[@]}"
    # one load level under torch.profiler (every thread's CUDA kernels and runtime calls, cudaMalloc
    # included): where the engine's first flow unit of 16 spends its time (286-327 ms on the H100 where
    # the probe's warm first chunks of 16 took 128)
    step cv2_load_profiled "$T_LOAD" "$PYTHON" -m bench.cv2_load --model-dir "$MODEL_DIR" "${LOAD[@]}" \
        --concurrency "${LEVELS_SMALL[-1]}" --profile-level "${LEVELS_SMALL[-1]}"
    # the decode steps read one at a time (before decode ahead, `llm.ahead`): TTFA and decode_first_hop_ms
    # against cv2_stream's, and the load's underruns against cv2_load's
    step cv2_stream_stepped "$T_STREAM" "$PYTHON" -m bench.cv2_stream --model-dir "$MODEL_DIR" "${STREAM[@]}" \
        --no-decode-ahead
    step cv2_load_stepped "$T_LOAD" "$PYTHON" -m bench.cv2_load --model-dir "$MODEL_DIR" "${LOAD[@]}" \
        --concurrency "${LEVELS_SMALL[@]}" --no-decode-ahead
    # the LLM on its own thread, decode graphs and CUDA stream (`[engine] llm = "thread"` + cuda_graphs):
    # its decode beside the engine's flow and vocoder replays instead of between them
    step cv2_load_llm_thread "$T_LOAD" "$PYTHON" -m bench.cv2_load --model-dir "$MODEL_DIR" "${LOAD[@]}" \
        --concurrency "${LEVELS_SMALL[@]}" --llm thread
    step cv2_stream_compiled "$T_COMPILED" "$PYTHON" -m bench.cv2_stream --model-dir "$MODEL_DIR" "${STREAM[@]}" --compile
    step cv2_load_compiled "$T_COMPILED" "$PYTHON" -m bench.cv2_load --model-dir "$MODEL_DIR" "${LOAD[@]}" \
        --concurrency "${LEVELS_SMALL[@]}" --compile
    # the same load with torch's allocator growing expandable segments instead of a cudaMalloc (each a
    # device-wide sync) per new block: compare its `device mallocs` and first-unit TTFA with cv2_load's
    step cv2_load_expandable "$T_LOAD" env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "$PYTHON" \
        -m bench.cv2_load --model-dir "$MODEL_DIR" "${LOAD[@]}" --concurrency "${LEVELS_SMALL[@]}"
fi

finish
