#!/usr/bin/env bash
# Compile every kernels/*.cu for sm_90 with `-Xptxas -v` and print one row per kernel:
# registers, spill stores/loads, stack frame, static shared memory. Fails on a compile error, or
# on a spill in a kernel not listed in kernels/spill-allow.txt.
#
#   tools/check-kernels.sh            # nvcc from INFOMEM_NVCC, CUDA_HOME, PATH or tools/install-nvcc.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

NVCC="${INFOMEM_NVCC:-}"
if [ -z "$NVCC" ] && [ -n "${CUDA_HOME:-}" ] && [ -x "$CUDA_HOME/bin/nvcc" ]; then NVCC="$CUDA_HOME/bin/nvcc"; fi
if [ -z "$NVCC" ] && command -v nvcc >/dev/null 2>&1; then NVCC="$(command -v nvcc)"; fi
if [ -z "$NVCC" ]; then NVCC="$(tools/install-nvcc.sh | tail -n 1)"; fi
echo "nvcc: $NVCC ($("$NVCC" --version | tail -n 1))"

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
allow="$(grep -v '^\s*#' kernels/spill-allow.txt 2>/dev/null | awk 'NF {print $1}' || true)"
status=0
printf '%-28s %-24s %5s %7s %7s %6s %7s\n' file kernel regs spill_st spill_ld stack smem
for src in kernels/*.cu; do
  name="$(basename "$src" .cu)"
  # the FMA contraction policy of build.rs (NO_FMAD): files that claim their CPU twin's order
  fmad=""
  if grep -q "NO_FMAD: &\[&str\] = &\[.*\"$name\"" build.rs; then fmad="-fmad=false"; fi
  if ! "$NVCC" -cubin -arch=sm_90 -O3 -std=c++17 -Ikernels $fmad -Xptxas -v -o "$tmp/$name.cubin" "$src" >"$tmp/$name.log" 2>&1; then
    echo "COMPILE ERROR in $src:" >&2
    cat "$tmp/$name.log" >&2
    status=1
    continue
  fi
  # ptxas prints, per entry: "Function properties for K" / "N bytes stack frame, S bytes spill
  # stores, L bytes spill loads" / "Used R registers, ..., M bytes smem"
  awk -v file="$name.cu" '
    /Function properties for/ { k = $NF; next }
    /bytes stack frame/ { stack[k] = $1; st[k] = $5; ld[k] = $9; next }
    /Used [0-9]+ registers/ {
      for (i = 1; i <= NF; i++) { if ($(i+1) == "registers,") regs[k] = $i; if ($(i+1) == "bytes" && $(i+2) == "smem") smem[k] = $i }
      order[++n] = k; next
    }
    END { for (i = 1; i <= n; i++) { k = order[i]; printf "%-28s %-24s %5s %7s %7s %6s %7s\n", file, k, regs[k], st[k], ld[k], stack[k], (smem[k] == "" ? 0 : smem[k]) } }
  ' "$tmp/$name.log" | tee -a "$tmp/table"
done
while read -r file kernel regs st ld stack smem; do
  if [ "${st:-0}" != 0 ] || [ "${ld:-0}" != 0 ]; then
    if printf '%s\n' $allow | grep -qx "$kernel"; then
      echo "allowed spill: $kernel (kernels/spill-allow.txt)"
    else
      echo "SPILL in $kernel ($file): $st bytes stored, $ld bytes loaded — fix it or list it in kernels/spill-allow.txt with a reason" >&2
      status=1
    fi
  fi
done < <(cat "$tmp/table" 2>/dev/null || true)
n="$(wc -l < "$tmp/table" 2>/dev/null || echo 0)"
if [ "$status" = 0 ]; then echo "check-kernels: $n kernels compiled for sm_90, no unexpected spills"; else echo "check-kernels: FAILED" >&2; fi
exit "$status"
