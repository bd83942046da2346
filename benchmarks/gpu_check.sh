#!/usr/bin/env bash
# Every GPU figure in one go on one GPU, in at most BUDGET seconds (330: run it with a timeout of 420 s or more).
# Each step writes its results into RESULTS_DIR as it ends (summary.txt, log.txt, throughput.json, kernels.md,
# runs.tar.gz: every run's CSV and output, no checkpoints), so a cut run still returns the steps before the cut:
#   1. accuracy: the default recipe (COMPILE off: no compile time in the clock) on the real images, width 64, global
#      batch 512, one rank, EPOCHS epochs, seeds 0 and 1, each timed as `time python train_distribute.py ...` (the
#      JPEGs unpacked before any clock): final holdout accuracy, 94% or not, wall clock, the folder's images/s
#   2. throughput (throughput.py): the seed (a), at its best (a'), at its best in bf16 + channels_last (a''), the
#      project eager (b) and compiled (b', its compile time from a cold cache), ratios and MFU
#   3. kernels (gpu_profile.py): the wall clock per step without the profiler, then the 25 slowest kernels by name
#      with their share of the kernel time, the project beside the seed at its best, after 12 untimed steps
#   4. two ranks on the one GPU: our launcher's 2 ranks, and 2 torchruns of one rank each, are each refused in a line
#   5. only if 60 s are left: out of GPU memory in epoch 2 (another process takes the free memory once epoch 1's CSV
#      is there; the run without the caching allocator) must end in one line, exit 1, epoch 1's files kept
# usage: bash benchmarks/gpu_check.sh ARCHIVE.tar.gz|IMAGEFOLDER RESULTS_DIR [EPOCHS]   (EPOCHS: 16 unless given)
# From a machine with a GPU (the archive travels in the ignored data/ folder, 16 MB):
#   mkdir -p data && cp CIFAR10_JPEG_ARCHIVE.tar.gz data/
#   bash benchmarks/gpu_check.sh data/CIFAR10_JPEG_ARCHIVE.tar.gz RESULTS_DIR
# Without a GPU, DRY_RUN=1 runs every step on the CPU at small sizes (tests/test_benchmarks.py does): a check of the
# script, not a figure.
set -uo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 2 ] || { echo "usage: bash benchmarks/gpu_check.sh ARCHIVE.tar.gz|IMAGEFOLDER RESULTS_DIR [EPOCHS]"; exit 2; }
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}  # the interpreter with the packages (tests give their own: a venv need not be active)
started=$SECONDS BUDGET=${BUDGET:-330} SLACK=1 WIDTH=64 BATCH=512 TP="--steps=60 --warmup=10" PROFILE="--steps=20" EPOCHS=${3:-16}
if [ -n "${DRY_RUN:-}" ]; then
  WIDTH=4 BATCH=32 TP="--steps=2 --warmup=1 --compiled=no" PROFILE="--steps=2 --warmup=1" EPOCHS=${3:-1}
  BUDGET=3600 SLACK=10  # the GPU's caps are no bound for a shared CPU: only the caller's timeout (a hang) is
fi
R=$(mkdir -p "$2" && cd "$2" && pwd) W=$(mktemp -d)
exec > >(tee -a "$R/log.txt") 2>&1
note() { echo "$*" | tee -a "$R/summary.txt"; }
left() { echo $((BUDGET - (SECONDS - started))); }
cap() { local l c=$(($1 * SLACK)); l=$(left); echo $((l < c ? (l > 1 ? l : 1) : c)); }  # a step's timeout: its cap, or what is left
keep() { tar -czf "$R/runs.tar.gz" -C "$W" --exclude='*.pt' --exclude='data' . 2>/dev/null; }

if [ -z "${DRY_RUN:-}" ]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$R/summary.txt" ||
    { echo "error: no GPU here (nvidia-smi failed); DRY_RUN=1 checks the script on the CPU"; exit 1; }
fi
# torch's version file read alone: importing torch takes seconds
version='from runpy import run_path; from importlib.util import find_spec as f; v = run_path(f("torch").origin[:-11] + "version.py")'
note "$("$PY" -c "$version; print('torch', v['__version__'], 'cuda', v['cuda'])") | $(nproc) cores"
data=$1
if [ -f "$1" ]; then  # unpacked before any clock starts
  data=$W/data && mkdir -p "$data" && tar -xzf "$1" -C "$data" || { echo "cannot unpack $1"; exit 1; }
fi
note "images: $(find "$data/train" -type f | wc -l) train, $(find "$data/test" -type f | wc -l) test in $data"

summary() {  # a run's CSV in one line: epochs, final accuracy, median training images/s after the first epoch
  "$PY" - "$1" <<'PY'
import os
import sys
import pandas as pd
if not os.path.exists(f"{sys.argv[1]}/pytorch_res.csv"):
    sys.exit("no epoch finished")
rows = pd.read_csv(f"{sys.argv[1]}/pytorch_res.csv")
later = rows["images_per_second"].iloc[1:] if len(rows) > 1 else rows["images_per_second"]
final = rows["acc"].iloc[-1]
print(f"{len(rows)} epochs, final acc {final:.4f} ({'94% reached' if final >= 0.94 else 'under 94%'}), images/s median "
      f"after epoch 1 {later.median():,.0f}, epoch 1 {rows['epoch_seconds'].iloc[0]:.1f} s")
PY
}

for seed in 0 1; do
  echo "== 1. accuracy: $EPOCHS epochs, seed $seed ($(left) s left)"
  out=$W/accuracy-s$seed
  TIMEFORMAT="real %R s" bash -c "time timeout -k 5 $(cap 100) '$PY' train_distribute.py --dataset=imagefolder \
    --data_dir='$data' --width=$WIDTH --batch_size=$BATCH --world_size=1 --epochs=$EPOCHS --seed=$seed \
    --output_dir='$out'" 2>&1 | tee "$out.log"
  note "accuracy, $EPOCHS epochs, seed $seed: $(grep '^real' "$out.log") (time python train_distribute.py ...); $(summary "$out" 2>&1)"
  keep
done

echo "== 2. throughput ($(left) s left)"
# shellcheck disable=SC2086  # TP holds several options
TORCHINDUCTOR_CACHE_DIR=$W/inductor timeout -k 5 "$(cap 100)" "$PY" -m benchmarks.throughput --world_size=1 \
  --width="$WIDTH" --batch_size="$BATCH" $TP --results "$R/throughput.json" | tee "$W/throughput.txt"
note "throughput: exit ${PIPESTATUS[0]} (compiled from a cold cache)"
grep -E "^(MFU|\((a|b|c))|x \|" "$W/throughput.txt" >> "$R/summary.txt"

echo "== 3. kernels ($(left) s left)"
# shellcheck disable=SC2086
timeout -k 5 "$(cap 60)" "$PY" -m benchmarks.gpu_profile --width="$WIDTH" --batch_size="$BATCH" $PROFILE \
  --out "$R/kernels.md" >/dev/null
note "kernels: exit $? (kernels.md)"; cat "$R/kernels.md" >> "$R/summary.txt" 2>/dev/null

[ -z "${DRY_RUN:-}" ] && {
  echo "== 4. two ranks on one GPU ($(left) s left)"
  CUDA_VISIBLE_DEVICES=0 timeout -k 5 "$(cap 30)" "$PY" train_distribute.py --dataset=synthetic --world_size=2 \
    --output_dir="$W/shared" > /dev/null 2> "$W/shared.err"
  note "2 ranks, 1 GPU: exit $? (want 2), $(grep -c . "$W/shared.err") line(s) (want 1): $(tail -n 1 "$W/shared.err")"
  for i in 1 2; do  # two agents of one job on this machine, each with its rank on GPU 0
    CUDA_VISIBLE_DEVICES=0 timeout -k 5 "$(cap 40)" "$PY" -m torch.distributed.run --nnodes=2 --nproc_per_node=1 \
      --rdzv_backend=c10d --rdzv_endpoint=localhost:29511 --rdzv_id=shared train_distribute.py --dataset=synthetic \
      --output_dir="$W/shared$i" > "$W/shared$i.log" 2>&1 &
  done
  wait
  note "2 torchruns, 1 GPU: $(cat "$W"/shared?.log | grep -c 'ranks would share GPU') lines naming it (want 2 or more: each rank's, torchrun's summaries)"
}

[ -z "${DRY_RUN:-}" ] && [ "$(left)" -gt 60 ] && {
  echo "== 5. out of GPU memory in epoch 2 ($(left) s left)"
  out=$W/out-of-memory
  "$PY" - "$out" <<'PY' &
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
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout -k 5 "$(cap 50)" "$PY" train_distribute.py --dataset=synthetic \
    --synthetic_size=20480 --width="$WIDTH" --batch_size="$BATCH" --world_size=1 --epochs=3 --output_dir="$out" \
    2> "$W/out-of-memory.err"
  code=$?
  kill "$other" 2>/dev/null; wait "$other" 2>/dev/null
  kept=$("$PY" -c "import torch; print(torch.load('$out/checkpoint.pt', weights_only=True)['epoch'])" 2>/dev/null)
  note "out of memory: exit $code (want 1), $(grep -c . "$W/out-of-memory.err") line(s) on stderr, checkpoint of epoch ${kept:-none} (want 1); last line: $(tail -n 1 "$W/out-of-memory.err")"
  keep
}
note "done in $((SECONDS - started)) s"
rm -rf "$W"
