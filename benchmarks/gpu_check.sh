#!/usr/bin/env bash
# The GPU figures of issue 42 in one go on one GPU, in at most BUDGET seconds (350: run it with a 7-minute timeout).
# Each step writes its results into RESULTS_DIR as it ends (summary.txt, log.txt, profile.md, throughput.json,
# runs.tar.gz: every run's CSV and output, no checkpoints), so a cut run still returns the steps before the cut:
#   1. profile: kernel time per training step by group, the project beside the seed at its best (gpu_profile.py)
#   5. out of GPU memory in epoch 2: another process takes the free memory once epoch 1's CSV is written; the run
#      (without the caching allocator, which would keep what it holds: every step asks the driver again) must end in
#      one line, exit 1, epoch 1's files kept
#   2. throughput, width 64, global batch 512, one rank: the seed (a), at its best (a'), in bf16 + channels_last (a''),
#      the project eager (b) and compiled (b', with its compile time), ratios and MFU (throughput.py)
#   3. the default recipe on the real images (width 64, batch 512, one rank; the JPEGs unpacked before any clock; no
#      compile cache of an earlier run), seeds 0 and 1, each timed as `time python train_distribute.py ...`: final
#      holdout accuracy and wall clock. A second EPOCHS count only if the first left a seed under 94% and time is left
#   4. the image folder's training images/s against --dataset synthetic of the same size and batch (median of the
#      epochs after the first)
# usage: bash benchmarks/gpu_check.sh ARCHIVE.tar.gz|IMAGEFOLDER RESULTS_DIR [EPOCHS [SECOND_EPOCHS]]
#   EPOCHS: the count to try first (default: train_distribute.py's EPOCHS); STEPS="3 4" runs only those steps.
# From a session with a GPU (the archive travels in the ignored data/ folder, 16 MB):
#   mkdir -p data && cp ../shared/data/cifar10-jpeg-trainval.tar.gz data/
#   run(command='bash benchmarks/gpu_check.sh data/cifar10-jpeg-trainval.tar.gz "$OUT"',
#       carry=['data/cifar10-jpeg-trainval.tar.gz'], timeout_s=420)
# A check of the script without a GPU (small sizes, on the CPU, no compiled run, no step 5): ALLOW_CPU=1 WIDTH=8
#   BATCH=64 SYNTHETIC=2000 TP_STEPS=2 TP_WARMUP=1 TP_COMPILED=no PROFILE_STEPS=2 BUDGET=1500 \
#   bash benchmarks/gpu_check.sh FOLDER RESULTS_DIR 1 2
set -uo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 2 ] || { echo "usage: bash benchmarks/gpu_check.sh ARCHIVE.tar.gz|IMAGEFOLDER RESULTS_DIR [EPOCHS [SECOND]]"; exit 2; }
export PYTHONUNBUFFERED=1
started=$SECONDS BUDGET=${BUDGET:-350} WIDTH=${WIDTH:-64} BATCH=${BATCH:-512} SYNTHETIC=${SYNTHETIC:-45000}
R=$(mkdir -p "$2" && cd "$2" && pwd) W=${WORK_DIR:-/tmp/gpu-check}
rm -rf "$W" && mkdir -p "$W"
exec > >(tee -a "$R/log.txt") 2>&1
note() { echo "$*" | tee -a "$R/summary.txt"; }
left() { echo $((BUDGET - (SECONDS - started))); }
cap() { local l; l=$(left); echo $((l < $1 ? (l > 1 ? l : 1) : $1)); }  # a step's timeout: its cap, or what is left
want() { [[ " ${STEPS:-1 5 2 3 4} " == *" $1 "* ]] && [ "$(left)" -gt 15 ]; }
keep() { tar -czf "$R/runs.tar.gz" -C "$W" --exclude='*.pt' --exclude='data' . 2>/dev/null; }

if [ -z "${ALLOW_CPU:-}" ]; then
  python3 -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'error: CUDA is not usable here (torch '
+ torch.__version__ + ', built for CUDA ' + str(torch.version.cuda) + '); run this on a GPU machine')" || exit 1
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$R/summary.txt"
fi
note "$(python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)") | $(nproc) cores"
data=$1
if [ -f "$1" ]; then  # unpacked before any clock starts
  data=$W/data && mkdir -p "$data" && tar -xzf "$1" -C "$data" || { echo "cannot unpack $1"; exit 1; }
fi
note "images: $(find "$data/train" -type f | wc -l) train, $(find "$data/test" -type f | wc -l) test in $data"
epochs=${3:-$(python3 -c "import train_distribute; print(train_distribute.EPOCHS)")}

summary() {  # a run's CSV in one line: epochs, final accuracy, median training images/s after the first epoch
  python3 - "$1" <<'PY'
import os
import sys
import pandas as pd
if not os.path.exists(f"{sys.argv[1]}/pytorch_res.csv"):
    sys.exit("no epoch finished")
rows = pd.read_csv(f"{sys.argv[1]}/pytorch_res.csv")
later = rows["images_per_second"].iloc[1:] if len(rows) > 1 else rows["images_per_second"]
print(f"{len(rows)} epochs, final acc {rows['acc'].iloc[-1]:.4f}, best {rows['acc'].max():.4f}, "
      f"images/s median after epoch 1 {later.median():,.0f}, epoch 1 {rows['epoch_seconds'].iloc[0]:.1f} s, "
      f"elapsed {rows['elapsed_seconds'].iloc[-1]:.1f} s")
PY
}

want 1 && {
  echo "== 1. profile ($(left) s left)"
  timeout -k 5 "$(cap 75)" python3 -m benchmarks.gpu_profile --width="$WIDTH" --batch_size="$BATCH" \
    --steps="${PROFILE_STEPS:-20}" --out "$R/profile.md" 2>&1 | grep -v "^USDT:\|^ERROR:.*DeviceProperties"
  note "profile: exit ${PIPESTATUS[0]} (table in profile.md)"; cat "$R/profile.md" >> "$R/summary.txt" 2>/dev/null
}

want 5 && [ -z "${ALLOW_CPU:-}" ] && {
  echo "== 5. out of GPU memory in epoch 2 ($(left) s left)"
  out=$W/out-of-memory
  python3 - "$out" <<'PY' &
import os, sys, time
import torch
torch.empty(1, device="cuda")  # this process's own CUDA context first: the taking itself is then at once
csv, deadline = os.path.join(sys.argv[1], "pytorch_res.csv"), time.monotonic() + 60
while not os.path.exists(csv):
    if time.monotonic() > deadline:
        sys.exit("other process: no epoch 1 within 60 s")
    time.sleep(0.002)
held = None
for _ in range(20):  # the run allocates and frees as it goes: take what is free now, less 16 MiB
    free, total = torch.cuda.mem_get_info()
    try:
        held = torch.empty(free - (16 << 20), dtype=torch.uint8, device="cuda")
        break
    except torch.cuda.OutOfMemoryError:
        continue
taken = 0 if held is None else held.numel() / 2**30
print(f"other process: took {taken:.1f} of {total / 2**30:.1f} GiB once epoch 1's CSV was there", flush=True)
time.sleep(120)
PY
  other=$!
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout -k 5 "$(cap 60)" python3 train_distribute.py --dataset=synthetic \
    --synthetic_size=20480 --width="$WIDTH" --batch_size="$BATCH" --world_size=1 --epochs=3 --output_dir="$out" \
    2> "$W/out-of-memory.err"
  code=$?
  kill "$other" 2>/dev/null; wait "$other" 2>/dev/null
  cat "$W/out-of-memory.err"
  kept=$(python3 -c "import torch; print(torch.load('$out/checkpoint.pt', weights_only=True)['epoch'])" 2>/dev/null)
  note "out of memory: exit $code (want 1), $(grep -c . "$W/out-of-memory.err") line(s) on stderr, checkpoint of epoch ${kept:-none} (want 1); last line: $(tail -n 1 "$W/out-of-memory.err")"
  keep
}

want 2 && {
  echo "== 2. throughput ($(left) s left)"
  timeout -k 5 "$(cap 160)" python3 -m benchmarks.throughput --world_size=1 --width="$WIDTH" --batch_size="$BATCH" \
    --steps="${TP_STEPS:-60}" --warmup="${TP_WARMUP:-10}" --compiled="${TP_COMPILED:-yes}" --results "$R/throughput.json" \
    | tee "$W/throughput.txt"
  note "throughput: exit $?"
  grep -E "^\((a|b|c)|x \|" "$W/throughput.txt" >> "$R/summary.txt"
}

accuracy() {  # the default recipe on the images, $1 epochs, seed $2; no compile cache of an earlier run
  local out=$W/accuracy-e$1-s$2
  TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) TRITON_CACHE_DIR=$(mktemp -d) TIMEFORMAT="real %R s" \
    bash -c "time timeout -k 5 $(cap 120) python3 train_distribute.py --dataset=imagefolder --data_dir='$data' \
      --width=$WIDTH --batch_size=$BATCH --world_size=1 --epochs=$1 --seed=$2 --output_dir='$out'" 2>&1 \
    | tee "$out.log"
  note "accuracy, $1 epochs, seed $2: $(grep '^real' "$out.log") wall clock (time python train_distribute.py ...); $(summary "$out" 2>&1)"
  keep
  python3 -c "import pandas as pd, sys; sys.exit(pd.read_csv('$out/pytorch_res.csv')['acc'].iloc[-1] < 0.94)" 2>/dev/null
}

want 3 && {
  missed=0
  for seed in 0 1; do
    echo "== 3. accuracy: $epochs epochs, seed $seed ($(left) s left)"
    accuracy "$epochs" "$seed" || missed=1
  done
  if [ $missed = 1 ] && [ -n "${4:-}" ] && [ "$(left)" -gt 130 ]; then
    for seed in 0 1; do
      echo "== 3. accuracy: $4 epochs, seed $seed ($(left) s left)"
      accuracy "$4" "$seed"
    done
  fi
}

want 4 && {
  echo "== 4. image folder against synthetic images ($(left) s left)"
  timeout -k 5 "$(cap 60)" python3 train_distribute.py --dataset=synthetic --synthetic_size="$SYNTHETIC" \
    --width="$WIDTH" --batch_size="$BATCH" --world_size=1 --epochs=3 --output_dir="$W/synthetic"
  note "synthetic, $SYNTHETIC images: $(summary "$W/synthetic" 2>&1)"
  folder=$(ls -d "$W"/accuracy-e*-s0 2>/dev/null | head -n 1)
  [ -n "$folder" ] && note "image folder ($folder): $(summary "$folder" 2>&1)"
  keep
}
note "done in $((SECONDS - started)) s"
