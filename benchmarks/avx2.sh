#!/usr/bin/env bash
# Runs a command as on an x86 CPU with AVX2 but no AVX-512: torch's kernels and oneDNN's limited to AVX2, and
# /proc/cpuinfo without the AVX-512 and AMX flags (so the run chooses fp32, as it does on such a CPU). An estimate
# on this machine's cores and clock, not a measurement of an AVX2 CPU. Needs root (a private mount namespace).
#   bash benchmarks/avx2.sh python3 -m pytest -q
set -euo pipefail
flags=$(mktemp)
sed -E 's/ (avx512[a-z0-9_]*|amx[a-z0-9_]*)//g' /proc/cpuinfo >"$flags"
# shellcheck disable=SC2016  # expanded by the inner shell
exec unshare --mount bash -c 'mount --bind "$0" /proc/cpuinfo && exec env ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 "$@"' "$flags" "$@"
