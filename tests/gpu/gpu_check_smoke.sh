#!/usr/bin/env bash
# tools/gpu-check without a GPU: a stand-in nvidia-smi that reports one H200,
# and the engine over the CUDA emulation (fsdp-lua-emu) in place of the GPU
# build, so that every stage of the script runs and its summary is read
# back: the stages' bookkeeping, the parsing of the recipe's log, the MFU
# arithmetic. Numbers are the emulation's (meaningless as speed).
#   bash tests/gpu/gpu_check_smoke.sh <build dir> <repo root>
set -u
BUILD=$(cd "${1:?usage: gpu_check_smoke.sh <build dir> <repo root>}" && pwd)
ROOT=$(cd "${2:?usage: gpu_check_smoke.sh <build dir> <repo root>}" && pwd)
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

cat >"$TMP/nvidia-smi" <<'SMI'
#!/usr/bin/env bash
# the answers tools/gpu-check asks for, as one H200 with 1000 MiB in use
case "$*" in
  -L) echo "GPU 0: NVIDIA H200 (UUID: GPU-00000000-emulated)" ;;
  *query-gpu=name*) echo "NVIDIA H200" ;;
  *query-gpu=driver_version*) echo "000.00-emulated" ;;
  *query-gpu=memory.used*-lms*) while true; do echo 1000; sleep 0.2; done ;;
  *query-gpu=memory.used*) echo 1000 ;;
  *) echo "stand-in nvidia-smi (tests/gpu/gpu_check_smoke.sh): one NVIDIA H200" ;;
esac
SMI
chmod +x "$TMP/nvidia-smi"

# the ctest stage runs two of the build's tests from a folder of its own (a
# ctest inside the build folder would write over the running ctest's logs)
mkdir -p "$TMP/ctest"
echo "subdirs(\"$BUILD/tests\")" >"$TMP/ctest/CTestTestfile.cmake"

export PATH="$TMP:$PATH" FSDP_EMU_GPUS=1
out=$(BUILD="$BUILD" BUDGET=600 GPU_CHECK_LOG="$TMP/gpu-check.log" GPU_CHECK_LAUNCHER="$BUILD/fsdp-lua-emu" \
      GPU_CHECK_KERNELS="$BUILD/tests/gpu/test_cuda_kernels_emu" GPU_CHECK_CTEST="-R ^lua\.test_(tensor|device)$" GPU_CHECK_CTEST_DIR="$TMP/ctest" \
      GPT2_PRESET=tiny GPT2_BATCH=4 GPT2_CTX=32 bash "$ROOT/tools/gpu-check" 2>&1)
rc=$?
echo "$out"
pass=0 fail=0
check() { if grep -qE -- "$2" <<<"$out"; then pass=$((pass + 1)); else fail=$((fail + 1)); echo "FAIL: $1 (no match for: $2)"; fi; }
check "summary"          "=+ gpu-check summary"
check "build stage"      "^build +PASS .*CUDA backend ON.*default device cuda"
check "ctest stage"      "^ctest +PASS .*100% tests passed, 0 tests failed out of 2"
check "kernel stage"     "^kernels +PASS .*[0-9]+ passed, 0 failed"
check "equiv stage"      "^equiv +PASS +[0-9]+s +NCCL 2.21.5\+emulated"
check "gpt2 numbers"     "^gpt2 +PASS .*[0-9]+ tokens/s \([0-9.]+ ms/step after step 5\), [0-9.]+ TFLOP/s = MFU [0-9.]+% of 989 TFLOP/s \(H100/H200 SXM dense bf16\); N=[0-9.]+M; loss [0-9.]+ -> [0-9.]+; peak engine memory [0-9.]+ MiB; GPU memory in use at most 0 MiB above the 1000 MiB before"
check "gpt2-fsdp stage"  "^gpt2-fsdp +PASS .*tokens/s"
[ $rc = 0 ] || { fail=$((fail + 1)); echo "FAIL: gpu-check exited $rc"; }
[ -s "$TMP/gpu-check.log" ] || { fail=$((fail + 1)); echo "FAIL: no log written"; }
echo "$pass passed, $fail failed"
[ $fail = 0 ]
