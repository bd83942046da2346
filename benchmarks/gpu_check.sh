#!/usr/bin/env bash
# The GPU figures in one go, on one GPU (estimated 10 minutes on one H200; not yet timed):
#   1. throughput, width 64, global batch 512: the seed's pipeline (literal and at its best) against this
#      project and the compute ceiling; MFU against the dense bf16 peak
#   2. GPU idle share over 20 profiled training steps, eager and compiled
#   3. the default recipe at full width on real images, eager: accuracy per epoch, time to 94% on the wall
#      clock from launch (each output line is stamped with the seconds since the run was launched: start-up
#      included; elapsed_seconds in the CSV starts with training), the write stall per epoch
#   4. the same run compiled: compile time, and the epoch from which COMPILE is ahead on the wall clock
#   5. the seed's recipe (Adam, constant LR, no augmentation) at width 64 for 30 epochs: its constant LR makes
#      these the first 30 epochs of its 100; the epoch and the seconds at which it first reaches 94%, if it does
# STEPS picks steps, e.g. STEPS=2 bash benchmarks/gpu_check.sh DIR runs step 2 alone (3 runs 3, 4 and 5).
# The default EPOCHS becomes the smallest count at which run 3 reached 94%, once a GPU has measured it.
# usage: bash benchmarks/gpu_check.sh [IMAGEFOLDER_DIR | ARCHIVE.tar.gz]
#   IMAGEFOLDER_DIR holds train/ and test/; an archive of such a tree is unpacked into runs/gpu-data first.
#   Without either, DATASET=cifar10 from ./data (downloaded if the machine is online).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
python3 -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else
'error: CUDA is not usable here (torch ' + torch.__version__ + ', built for CUDA ' + str(torch.version.cuda) + '); run this on a GPU machine')" || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"

data=(--dataset=cifar10)
if [ -n "${1:-}" ]; then
  root=$1
  if [ -f "$1" ]; then
    root=runs/gpu-data
    [ -d "$root/train" ] || { mkdir -p "$root" && tar -xzf "$1" -C "$root"; } || { echo "cannot unpack $1"; exit 1; }
  fi
  data=(--dataset=imagefolder "--data_dir=$root")
fi

want() { [[ " ${STEPS:-1 2 3} " == *" $1 "* ]]; }
stamp() {  # each line, prefixed by the seconds since this filter (and the command before the pipe) started
  python3 -u -c 'import sys, time
started = time.monotonic()
for line in sys.stdin:
    print(f"{time.monotonic() - started:9.2f}  {line}", end="", flush=True)'
}

want 1 && {
echo "== 1. throughput (width 64, global batch 512, one GPU)"
python3 -m benchmarks.throughput --world_size=1 --batch_size=512 --steps=60 --warmup=10
python3 -m benchmarks.throughput --world_size=1 --batch_size=512 --steps=60 --warmup=10 --compile --skip_seed
}
want 2 && {
echo "== 2. GPU idle share over 20 profiled steps"
python3 -m benchmarks.gpu_profile --width=64 --batch_size=512 --steps=20
python3 -m benchmarks.gpu_profile --width=64 --batch_size=512 --steps=20 --compile
}
want 3 || exit 0

seed_recipe=(--optimizer=adam --lr=1e-3 --schedule=constant --batch_size=256 --weight_decay=0 --label_smoothing=0
             --augment=False --tta=False --epochs=30)
for mode in eager compiled seed; do
  echo "== 3/4/5. accuracy: width 64, $mode"
  out=runs/gpu-accuracy-$mode
  rm -rf "$out" "$out.log"
  mkdir -p runs
  recipe=(--compile=False)
  [ $mode = compiled ] && recipe=(--compile=True)
  [ $mode = seed ] && recipe=("${seed_recipe[@]}")
  python3 train_distribute.py "${data[@]}" --width=64 --world_size=1 --output_dir="$out" "${recipe[@]}" 2>&1 \
    | stamp | tee "$out.log"
  [ -f "$out/pytorch_res.csv" ] || { echo "the $mode accuracy run wrote no CSV"; exit 1; }
done

python3 - runs/gpu-accuracy-{eager,compiled,seed} <<'PY'
import re
import sys
import pandas as pd

def read(out):
    """The run's CSV, with launched_seconds: the seconds from launch to the epoch's line (stamped in its log)."""
    df = pd.read_csv(f"{out}/pytorch_res.csv")
    with open(f"{out}.log") as f:
        stamps = dict(
            (int(m[2]), float(m[1])) for m in (re.match(r"\s*([\d.]+)  epoch (\d+)/", line) for line in f) if m
        )
    df["launched_seconds"] = df["epoch"].map(stamps)
    return df

eager, compiled, seed = (read(out) for out in sys.argv[1:4])
print(eager[["epoch", "loss", "acc", "epoch_seconds", "launched_seconds", "images_per_second",
             "write_wait_seconds"]].to_string(index=False))
for name, df in (("default recipe, eager", eager), ("default recipe, compiled", compiled), ("seed's recipe", seed)):
    hit = df[df["acc"] >= 0.94]
    gaps = df["elapsed_seconds"].diff().iloc[1:] - df["epoch_seconds"].iloc[1:]
    print(f"{name}: start-up {df['launched_seconds'].iloc[0] - df['epoch_seconds'].iloc[0]:.1f} s (launch to "
          f"epoch 1's line, less the epoch); write stall per epoch: median {gaps.median():.3f} s (time between "
          f"epochs beyond the epoch itself), waits for the writer {df['write_wait_seconds'].sum():.2f} s in all")
    if len(hit):
        first = hit.iloc[0]
        print(f"{name}: 94% first at epoch {int(first['epoch'])}, {first['launched_seconds']:.1f} s after launch")
    else:
        best = df.loc[df["acc"].idxmax()]
        print(f"{name}: 94% not reached: best {best['acc']:.4f} at epoch {int(best['epoch'])} "
              f"({best['launched_seconds']:.1f} s after launch)")
print(f"compile time (first epoch, compiled minus eager): "
      f"{compiled['epoch_seconds'].iloc[0] - eager['epoch_seconds'].iloc[0]:.1f} s; steady epoch "
      f"{eager['epoch_seconds'].iloc[2:].median():.3f} s eager, {compiled['epoch_seconds'].iloc[2:].median():.3f} s compiled")
ahead = compiled[compiled["launched_seconds"].values < eager["launched_seconds"].values]
print("COMPILE is ahead on the wall clock from launch from epoch " + (str(int(ahead.iloc[0]["epoch"])) if len(ahead)
      else f"- (never within {len(eager)} epochs)"))
PY
