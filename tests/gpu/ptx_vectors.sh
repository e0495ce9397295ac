#!/usr/bin/env bash
# The 16-byte accesses of the memory-bound CUDA kernels, as nvcc compiles
# them (ctest gpu.ptx_vectors): each kernel listed must load, and where it
# writes store, with 16-byte vector instructions (ld/st.global...v4) in its
# PTX. A struct of narrower elements without alignas(16) is moved as one
# element at a time (eight 2-byte loads for 8 bf16): correct everywhere, at a
# fraction of the bandwidth on a GPU, and visible only in the PTX or a
# profiler, never in the emulation's results.
#   bash tests/gpu/ptx_vectors.sh <nvcc> <repo root>
set -u
NVCC=${1:?usage: ptx_vectors.sh <nvcc> <repo root>}
ROOT=${2:?usage: ptx_vectors.sh <nvcc> <repo root>}
INC=()
for d in include core cpu ops distributed cuda; do INC+=(-I "$ROOT/engine/$d"); done
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
pass=0 fail=0

# file  kernel (the name as it starts the mangled one)  what it must have: ld, or ld+st
while read -r file kernel need; do
  [ -n "$file" ] || continue
  ptx=$TMP/$file.ptx
  if [ ! -f "$ptx" ]; then
    "$NVCC" -DFSDP_HAVE_CUDA=1 "${INC[@]}" -O3 -arch=compute_90 -std=c++20 -ptx \
      "$ROOT/engine/cuda/$file.cu" -o "$ptx" || { echo "FAIL: nvcc -ptx $file.cu"; fail=$((fail + 1)); continue; }
  fi
  body=$(awk -v k="$kernel" '$0 ~ "\\.entry _Z[0-9]+" k { on = 1 } on { print } on && /^}/ { exit }' "$ptx")
  if [ -z "$body" ]; then echo "FAIL: $file.cu has no kernel $kernel"; fail=$((fail + 1)); continue; fi
  lv=$(echo "$body" | grep -cE 'ld\.global[.a-z]*\.v4\.')
  sv=$(echo "$body" | grep -cE 'st(\.global)?\.v4\.')
  ok=1
  [ "$lv" -gt 0 ] || ok=0
  [ "$need" = ld ] || [ "$sv" -gt 0 ] || ok=0
  if [ $ok = 1 ]; then echo "ok: $kernel ($file.cu): $lv 16-byte loads, $sv 16-byte stores"; pass=$((pass + 1))
  else echo "FAIL: $kernel ($file.cu): $lv 16-byte loads, $sv 16-byte stores ($need expected)"; fail=$((fail + 1)); fi
done <<'EOF'
elementwise binary_contig_bf16x8_kernel ld+st
elementwise axpy_bf16x8_kernel ld+st
elementwise axpy_f32_bf16x8_kernel ld+st
fused bias_gelu_fwd_kernelItLi8 ld+st
fused bias_gelu_fwd_kernelIfLi4 ld+st
fused bias_gelu_bwd_kernelItLi8 ld+st
fused bias_gelu_bwd_kernelIfLi4 ld+st
fused bias_residual_kernelItLi8 ld+st
fused bias_residual_kernelIfLi4 ld+st
loss ce_fwd_kernelItLi8 ld
loss ce_fwd_kernelIfLi4 ld
loss ce_fused_kernelItLi8 ld+st
loss ce_fused_kernelIfLi4 ld+st
attention_flash fa_forward_kernelILi64 ld+st
attention_flash fa_dq_kernelILi64 ld+st
attention_flash fa_dkdv_kernelILi64 ld+st
embedding emb_accumulate_kernelItLi8 ld+st
embedding emb_accumulate_kernelIfLi4 ld+st
EOF
echo "$pass passed, $fail failed"
[ $fail = 0 ]
