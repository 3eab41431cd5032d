#!/usr/bin/env bash
# Everything measured on the GPU machine, in one place. Run from the repo root on a CUDA host:
#   bash scripts/gpu_session.sh tests    # GPU tests + start-up times (cold vs warm Triton cache)
#   bash scripts/gpu_session.sh bench    # (a) forward floor, (b) hsextract loop, (c) blocking loop, one process
#   bash scripts/gpu_session.sh kernels  # fused kernels: GPU correctness tests, then each kernel alone (profile)
#   bash scripts/gpu_session.sh fused    # (a), (b) against (a'), (b') with fused kernels; warm start-up after it
#   bash scripts/gpu_session.sh issue13  # kernels, then fused
#   bash scripts/gpu_session.sh fp8      # (a), (b), (b8) with the final state; fp8 error on real states
#   bash scripts/gpu_session.sh startup  # the real command's start-up, cold / warm / resume (~9 min)
#   bash scripts/gpu_session.sh forward  # the full forward against the power cap: variants, profile, ceilings
#   bash scripts/gpu_session.sh steadyrun  # the real command run to its end: steady real tokens/s
# flash-linear-attention and liger-kernel come from wheels in .whl/ (fla-core, flash-linear-attention,
# liger-kernel) when they are not installed.
set -uo pipefail
OUT=${OUT:-/tmp/hsextract-gpu-out}
mkdir -p "$OUT"
if ! python3 -c "import fla, liger_kernel" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD/src PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers, fla, triton; from importlib.metadata import version as v; print('torch', torch.__version__, 'transformers', transformers.__version__, 'fla', fla.__version__, 'triton', triton.__version__, 'liger-kernel', v('liger-kernel'))"
date -u
# The 64-layer random checkpoint of Qwen3.6-27B's shape that the start-up and steady-state modes run on (~54 GB,
# ~70 s), made once per machine (CKPT=DIR reuses one made earlier); $1: its time limit in seconds.
CKPT=${CKPT:-/tmp/hsextract-ckpt-27b}
ensure_checkpoint() {
  if [[ ! -f "$CKPT/.complete" ]]; then
    rm -rf "$CKPT"
    timeout "$1" python3 scripts/make_checkpoint.py configs/qwen3.6-27b "$CKPT" > "$OUT/ckpt.json" 2>&1 \
      && touch "$CKPT/.complete"
    tail -n 1 "$OUT/ckpt.json"
  fi
}
case "${1:-all}" in
  tests|all)
    python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_gpu.py 2>&1 | tee "$OUT/gpu_tests.log"
    python3 scripts/bench.py --startup --modes none --json-out "$OUT/startup.json" 2>&1 | tee "$OUT/startup.log"
    ;;&
  bench|all)
    python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu.py -k fla 2>&1 | tail -3
    python3 scripts/bench.py --tokens "${BENCH_TOKENS:-700000}" --max-tokens "${BENCH_BATCH:-32768}" \
      --json-out "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log"
    ;;
esac
# Fused kernels . kernels: correctness (fused vs float32 at least as close as stock, per module and per
# layer), then each swapped module timed alone and the shallow forward's profile, stock against fused.
# fused: the full forward, stock (a), (b) against fused (a'), (b'), one process; then fresh processes starting with
# the Triton cache that run left (the warm start a real run has after its pre-warm), fused and stock.
# Each step runs under a time limit (seconds, from the environment) so one call of the GPU machine holds them all.
if [[ "${1:-}" == "kernels" || "${1:-}" == "issue13" ]]; then
  timeout "${TESTS_TIMEOUT:-300}" python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_kernels_gpu.py tests/unit/test_kernels.py 2>&1 | tee "$OUT/kernels_tests.log"
  timeout "${PROFILE_TIMEOUT:-300}" python3 scripts/bench.py --kernel-profile --json-out "$OUT/kernel_profile.json" 2>&1 | tee "$OUT/kernel_profile.log"
fi
if [[ "${1:-}" == "fused" || "${1:-}" == "issue13" ]]; then
  export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-fused}
  timeout "${BENCH_TIMEOUT:-480}" python3 scripts/bench.py --tokens "${BENCH_TOKENS:-300000}" --max-tokens "${BENCH_BATCH:-32768}" \
    --modes "${BENCH_MODES:-a,af,b,bf}" --json-out "$OUT/bench_fused.json" 2>&1 | tee "$OUT/bench_fused.log"
  timeout "${STARTUP_TIMEOUT:-110}" python3 scripts/bench.py --startup --startup-cache "$TRITON_CACHE_DIR" --modes none \
    --startup-kernels fused,stock --max-tokens "${BENCH_BATCH:-32768}" --json-out "$OUT/startup_fused.json" 2>&1 | tee "$OUT/startup_fused.log"
fi
# fp8 storage and the final state: the forward floor to the last layer against the worker loop storing
# bfloat16 and fp8 quantized on the GPU, one process, with the fused kernels a CUDA run uses by default: (a'), (b'),
# (b8'); (b8')/(a') must stay >= 0.97 (BENCH_MODES=a,b,b8 for the stock forward). Then the fp8 error per layer on
# real-shaped states of the GPU forward (random weights; the dry run reports it on a real checkpoint).
if [[ "${1:-}" == "fp8" ]]; then
  export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-fused}
  timeout "${BENCH_TIMEOUT:-540}" python3 scripts/bench.py --final-state --tokens "${BENCH_TOKENS:-300000}" \
    --max-tokens "${BENCH_BATCH:-32768}" --modes "${BENCH_MODES:-af,bf,bf8}" --json-out "$OUT/bench_fp8.json" 2>&1 | tee "$OUT/bench_fp8.log"
  timeout "${FP8_TIMEOUT:-300}" python3 scripts/fp8_error.py --gpu-config configs/qwen3.6-27b \
    --json-out "$OUT/fp8_error.json" 2>&1 | tee "$OUT/fp8_error.log"
fi
# Several shards on the GPUs this machine has: random-weight checkpoint of the real layer shapes, then
# scripts/multi_shard.py (single vs N shards, kill + resume, exactly-once check). GPUS=0,0,0,0 shares one GPU.
if [[ "${1:-}" == "multishard" ]]; then
  python3 scripts/make_checkpoint.py configs/qwen3.6-27b /tmp/ckpt --layers "${CKPT_LAYERS:-8}" | tee "$OUT/ckpt.json"
  python3 scripts/multi_shard.py --model /tmp/ckpt --work /tmp/ms --staging-root /dev/shm/hsextract-ms \
    --shards "${SHARDS:-4}" --gpus "${GPUS:-0,0,0,0}" --tokens "${MS_TOKENS:-400000}" --layers 1,4,6 \
    --json-out "$OUT/multishard.json" 2>&1 | tee "$OUT/multishard.log"
  df -h /tmp /dev/shm | tee -a "$OUT/multishard.log"
  tail -n 20 /tmp/ms/multi-run/logs/shard-00000.log > "$OUT/shard0.log" 2>/dev/null
fi
# Start-up of the real command: a 64-layer random checkpoint of Qwen3.6-27B's shape (made once, ~54 GB,
# then read from the page cache), then scripts/bench_startup.py: time from `hsextract run` to the first durable
# batch. untuned: an empty kernel cache and no autotune tables (every candidate config timed, as before the
# tables); its warm-up's recorded table becomes the one shipped for this GPU (src/hsextract/model/autotune_tables/,
# copied to $OUT). cold: an empty kernel cache with that table (a machine that never ran hsextract); warm: a new
# job with the cache cold left; fresh: a new job on new data; resume: the warm job again; each stopped after its
# first durable batch, phases from the logs. Then the model load alone (fast reader, its profile, transformers'
# reader with 4 threads). 300,000 tokens of data (about 7 batches of 65,536), output and staging in /dev/shm.
# CKPT=DIR reuses a checkpoint made earlier on this machine. The runs' logs go to $OUT/startup-logs.tgz.
if [[ "${1:-}" == "startup" ]]; then
  T0=$SECONDS
  ensure_checkpoint "${CKPT_TIMEOUT:-200}"
  df -h /tmp /dev/shm | tail -2
  TABLE=src/hsextract/model/autotune_tables/$(python3 -c "import torch, re; print(re.sub(r'[^0-9A-Za-z]+', '_', torch.cuda.get_device_name()).strip('_'))").json
  # What is left of ~9 minutes goes to the steps (each at most STEP_TIMEOUT s); figures print as they come.
  LEFT=$(( ${SESSION_S:-520} - (SECONDS - T0) ))
  timeout $(( LEFT + 20 )) python3 scripts/bench_startup.py --model "$CKPT" --work /tmp/hsextract-startup \
    --tokens "${STARTUP_TOKENS:-300000}" --steps "${STEPS:-untuned,cold,warm,fresh,resume,load}" --step-timeout "${STEP_TIMEOUT:-200}" \
    --load-variants "${LOAD_VARIANTS:-fast,profile,4}" --ship-table "$TABLE" --total-timeout "$LEFT" \
    --json-out "$OUT/startup_run.json" 2>&1 | tee "$OUT/startup_run.log"
  [[ -f "$TABLE" ]] && cp "$TABLE" "$OUT/"
  tar czf "$OUT/startup-logs.tgz" /tmp/hsextract-startup/*-run/logs /tmp/hsextract-startup/*.out 2>/dev/null
  grep -h "^figure" "$OUT/startup_run.log" | grep -E "first_durable_s|prepare_s|prewarm_s |prewarm_skipped|\.load_s|kernel_wait_s|first_batch_after_load_s|first_upload_s|threads_|load\.|tuned"
fi
# After the shipped table: start-up with it (cold, warm, fresh, resume), what the integrity checks cost
# (scripts/bench_checks.py), then the GPU tests of the table and of a real two-shard run; ~9 minutes.
if [[ "${1:-}" == "final" ]]; then
  T1=$SECONDS
  STEPS=${STEPS:-cold,warm,fresh,resume} SESSION_S=${STARTUP_S:-330} bash "$0" startup
  timeout 90 python3 scripts/bench_checks.py 2>&1 | tee "$OUT/checks.log"
  timeout $(( ${FINAL_S:-560} - (SECONDS - T1) )) python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_gpu.py \
    -k "tuned or two_shards" 2>&1 | tail -40 | tee "$OUT/gpu_tests.log"
fi
# Host buffers pinned by the early worker while it imports (run/hostmem.py), session 3 of 2026-12-01: what pinning
# costs two ways (scripts/bench_pinning.py), what the early worker's imports cost on an idle host (-X importtime,
# the 25 slowest by cumulative time), the GPU tests of the pinned buffers and of the shipped table, then start-up
# cold, warm and resume with the launcher's lines timed (bench_startup.py's timeline). ~8 minutes.
if [[ "${1:-}" == "early2" ]]; then
  timeout 90 python3 scripts/bench_pinning.py --slots 3 --gb 2.75 2>&1 | tee "$OUT/pinning.log"
  timeout 60 python3 -X importtime -c "from hsextract.run.prestart import _warm_imports; _warm_imports('configs/qwen3.6-27b')" \
    2> "$OUT/importtime.txt"
  grep '^import time:' "$OUT/importtime.txt" | sort -t'|' -k2 -n -r | head -25
  timeout 150 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_gpu.py -k "host_buffers or autotune_table" \
    2>&1 | tail -30 | tee "$OUT/gpu_tests.log"
  STEPS=${STEPS:-cold,warm,resume} SESSION_S=${STARTUP_S:-330} bash "$0" startup
  grep -h "^figure" "$OUT/startup_run.log" | grep -E "early_|timeline" | cut -c1-3000
fi
# The steady state and the training loader, session 3 of 2026-12-01: a new batch shape's cost beside its forward
# with board power and SM clock (scripts/bench_shapes.py, on the start-up checkpoint, made here if missing), then
# what one loader process delivers into pinned GPU-ready tensors (bench_loader_gpu.py) and the trainer's own
# loader on the export against hsextract's dataset with 1, 2, 4 DataLoader workers (bench_loader.py, local only:
# --no-s3). ~7 minutes.
if [[ "${1:-}" == "steady" ]]; then
  ensure_checkpoint "${CKPT_TIMEOUT:-200}"
  timeout "${SHAPES_TIMEOUT:-200}" python3 scripts/bench_shapes.py --model "$CKPT" --tokens "${SHAPES_TOKENS:-300000}" 2>&1 \
    | grep -v Warning | tee "$OUT/shapes.log"
  timeout 100 python3 scripts/bench_loader_gpu.py --files 6 --tokens 16384 --threads 1,4,8 --repeat 2 2>&1 | tee "$OUT/loader_gpu.log"
  timeout 150 python3 scripts/bench_loader.py --files 8 --tokens 16384 --workers 1,2,4 --no-s3 --repeat 2 2>&1 | tee "$OUT/loader.log"
fi
# The same, once more: the GPU tests of a real two-shard run and of the fp8 pipeline (both through the pinned host
# buffers), the trainer's own loader on the export against hsextract's dataset (SpecForge carried as a wheel),
# then a new shape's cost after the run's own warm-up of the plan (bench_shapes.py --prewarm), as a run has it.
if [[ "${1:-}" == "steady2" ]]; then
  timeout 120 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_gpu.py -k "two_shards or fp8_pipeline" \
    2>&1 | tail -5 | tee "$OUT/gpu_tests.log"
  timeout 170 python3 scripts/bench_loader.py --files 6 --tokens 16384 --workers 1,2,4 --no-s3 --repeat 2 2>&1 | tee "$OUT/loader.log"
  ensure_checkpoint 100
  timeout 170 python3 scripts/bench_shapes.py --model "$CKPT" --tokens 300000 --prewarm 2>&1 | grep -v Warning | tee "$OUT/shapes.log"
fi
# The full forward against the power cap (#22's forward target), session 4 of 2026-12-01: the capped GEMM rate, then
# fused (with its profile and ceilings), stock, fused with the MLP's gate and up as two GEMMs, fused with q and k
# repeated before FLA's rule (scripts/bench_forward.py), layers 0..61 of the 27B shape. ~7 minutes.
if [[ "${1:-}" == "forward" ]]; then
  export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-forward}
  timeout "${FORWARD_TIMEOUT:-540}" python3 scripts/bench_forward.py --tokens "${FORWARD_TOKENS:-200000}" \
    --repeat "${FORWARD_REPEAT:-2}" --variants "${FORWARD_VARIANTS:-fused,stock,fused-mlp-separate,fused-repeat-qk}" \
    --json-out "$OUT/forward.json" 2>&1 | grep -v Warning | tee "$OUT/forward.log"
fi
# The fused kernels' GPU tests on this code (per module and per layer against float32, the MLP's joined gate/up
# included), then a real two-shard CLI run compared with HF and the hooks on the real shape. ~5 minutes.
if [[ "${1:-}" == "forwardtests" ]]; then
  timeout "${TESTS_TIMEOUT:-330}" python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_kernels_gpu.py tests/unit/test_kernels.py \
    2>&1 | tail -40 | tee "$OUT/kernels_tests.log"
  timeout "${GPU_TESTS_TIMEOUT:-300}" python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_gpu.py -k "two_shards or hooks_on_real" \
    2>&1 | tail -8 | tee "$OUT/gpu_tests.log"
fi
# The real command's steady state (session 4 of 2026-12-01): a job on the start-up checkpoint (made here if missing)
# run to its end, real tokens/s between the batches written after its first two, and the uploader's seconds per file
# (bench_startup.py --steps steady). 500,000 tokens: ~26 GB of output in /dev/shm. ~4 minutes.
if [[ "${1:-}" == "steadyrun" ]]; then
  ensure_checkpoint 120
  df -h /dev/shm | tail -1
  timeout "${STEADY_TIMEOUT:-400}" python3 scripts/bench_startup.py --model "$CKPT" --work /tmp/hsextract-steady \
    --tokens "${STEADY_TOKENS:-500000}" --steps steady --step-timeout "${STEADY_STEP_S:-380}" \
    --json-out "$OUT/steady_run.json" > "$OUT/steady_run.log" 2>&1
  grep -E "^figure (setup|steady\.(first_durable|wall|finished|steady|batches|tokens_written|write|file|upload|load_s|prewarm_s|exit))" "$OUT/steady_run.log"
  tail -n 5 /tmp/hsextract-steady/steady-run/logs/shard-00000.log 2>/dev/null
fi
