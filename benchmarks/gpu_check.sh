#!/usr/bin/env bash
# The GPU figures in one go (estimated 3-5 minutes on one H200; not yet timed):
#   1. throughput, world size 1 with NCCL: the seed's pipeline against this project (and the compiled variant)
#   2. the default recipe at full width on real CIFAR-10 images: accuracy per epoch and time to 94%
# usage: bash benchmarks/gpu_check.sh [IMAGEFOLDER_DIR]
#   IMAGEFOLDER_DIR holds train/ and test/ (DATASET=imagefolder); without it, DATASET=cifar10 from ./data.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"

echo "== 1. throughput (global batch 512, width 64)"
python3 benchmarks/throughput.py --world_size=1 --batch_size=512 --steps=60 --warmup=10
python3 benchmarks/throughput.py --world_size=1 --batch_size=512 --steps=60 --warmup=10 --compile

echo "== 2. accuracy: default recipe, width 64"
if [ -n "${1:-}" ]; then data=(--dataset=imagefolder "--data_dir=$1"); else data=(--dataset=cifar10); fi
out=runs/gpu-accuracy
rm -rf "$out"
python3 train_distribute.py "${data[@]}" --width=64 --world_size=1 --output_dir="$out"
[ -f "$out/pytorch_res.csv" ] || { echo "the accuracy run wrote no CSV"; exit 1; }
python3 - "$out/pytorch_res.csv" <<'PY'
import sys
import pandas as pd
df = pd.read_csv(sys.argv[1])
df["elapsed"] = df["epoch_seconds"].cumsum()
hit = df[df["acc"] >= 0.94]
print(df[["epoch", "loss", "acc", "epoch_seconds", "images_per_second", "elapsed"]].to_string(index=False))
if len(hit):
    print(f"94% first at epoch {int(hit.iloc[0]['epoch'])}, {hit.iloc[0]['elapsed']:.1f} s of training and evaluation")
else:
    print(f"94% not reached: best {df['acc'].max():.4f} at epoch {int(df.loc[df['acc'].idxmax(), 'epoch'])}")
PY
