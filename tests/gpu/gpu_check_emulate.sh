#!/usr/bin/env bash
# The dry run of the GPU check (ctest emu.tools.gpu_check): tools/gpu-bundle
# makes the bundle (once; kept in the build folder), then
# tools/gpu-check --emulate runs every stage over the host-guarded emulation
# in an environment of the bundle alone, and its results.json is read back.
# Then the one-line failures: no GPU, a missing bundle.
#   bash tests/gpu/gpu_check_emulate.sh <build dir> <repo root>
set -u
BUILD=$(cd "${1:?usage: gpu_check_emulate.sh <build dir> <repo root>}" && pwd)
ROOT=$(cd "${2:?usage: gpu_check_emulate.sh <build dir> <repo root>}" && pwd)
BUNDLE=$BUILD/gpu-bundle
CHECK=$BUILD/gpu-check-emu
OUT=$CHECK/gpu-check-out
pass=0 fail=0
ok() { pass=$((pass + 1)); echo "ok: $1"; }
bad() { fail=$((fail + 1)); echo "FAIL: $1"; }

# the bundle: made once (it needs apt-get download, so network to a Debian mirror)
if [ ! -f "$BUNDLE/MANIFEST" ] || [ "$ROOT/tools/gpu-bundle" -nt "$BUNDLE/MANIFEST" ]; then
  rm -rf "$BUNDLE"
  "$ROOT/tools/gpu-bundle" "$BUNDLE" || { echo "FAIL: tools/gpu-bundle"; exit 1; }
fi
size=$(du -sb "$BUNDLE" | cut -f1)
[ "$size" -lt $((48 << 20)) ] && ok "bundle is $((size >> 20)) MiB (< 48)" || bad "bundle is $((size >> 20)) MiB"

# stand-ins for the tools as a sandboxed runtime answers them: the
# sanitizer does not support the device, ncu may not read the counters (and
# records what it was asked, to see that it never changes the clocks)
STANDIN=$CHECK/standin
mkdir -p "$STANDIN"
rm -f "$STANDIN/ncu.args"
cat >"$STANDIN/compute-sanitizer" <<'SH'
#!/bin/sh
echo "========= COMPUTE-SANITIZER"
echo "========= Error: Device not supported. Only devices with compute capability 7.5 and above are supported."
exit 1
SH
cat >"$STANDIN/ncu" <<SH
#!/bin/sh
echo "\$*" >"$STANDIN/ncu.args"
echo "==PROF== Connected to process 1 (test_cuda_kernels)" >&2
echo "==ERROR== ERR_NVGPUCTRPERM - The user does not have permission to access NVIDIA GPU Performance Counters on the target device 0." >&2
exit 1
SH
chmod +x "$STANDIN/compute-sanitizer" "$STANDIN/ncu"

BUILD=$CHECK GPU_CHECK_OUT=$OUT GPU_CHECK_SANITIZER=$STANDIN/compute-sanitizer GPU_CHECK_NCU=$STANDIN/ncu \
  "$ROOT/tools/gpu-check" --emulate --bundle "$BUNDLE"
rc=$?
[ $rc = 0 ] && ok "gpu-check --emulate exit 0" || bad "gpu-check --emulate exited $rc"

R=$OUT/results.json
if /usr/bin/python3 - "$R" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
st = {s["name"]: s for s in r["stages"]}
want = {"build": "PASS", "kernels": "PASS", "gpt2": "PASS", "gpt2-fsdp": "PASS", "equiv": "PASS", "ctest": "PASS",
        "racecheck": "SKIPPED", "memcheck": "SKIPPED", "flash-dram": "SKIPPED"}
bad = [f"{k}: {st.get(k, {}).get('status')} ({st.get(k, {}).get('figures', {}).get('summary')})"
       for k, v in want.items() if st.get(k, {}).get("status") != v]
f = {k: s["figures"] for k, s in st.items()}
checks = [
    (r["mode"] == "emulate", "mode emulate"),
    ("bundle" in r["preflight"]["plan"], "plan uses the bundle: " + r["preflight"].get("plan", "")),
    (f["build"].get("ldd") == "clean", "ldd: " + str(f["build"].get("ldd"))),
    ("NCCL" in f["gpt2-fsdp"].get("nccl", ""), "the NCCL stage saw NCCL"),
    (float(f["gpt2"].get("parameters_M", 0)) > 0, "gpt2 parameters parsed"),
    ("tokens_per_s" not in f["gpt2"], "no emulation speed reported"),
    ("passed, 0 failed" in f["kernels"].get("result", ""), "kernel test: " + f["kernels"].get("result", "")),
    (all(isinstance(s["seconds"], int) for s in r["stages"]), "seconds per stage"),
]
# the machine's refusals are SKIPPED with the tool's line, not failures of the code
for k, what in (("racecheck", "Device not supported"), ("memcheck", "Device not supported"),
                ("flash-dram", "ERR_NVGPUCTRPERM")):
    summ = str(st.get(k, {}).get("figures", {}).get("summary", ""))
    checks.append(("the machine refused the tool" in summ and what in summ, f"{k} names the refusal: {summ}"))
for good, what in checks:
    if not good: bad.append(what)
print("results.json:", "; ".join(bad) if bad else "as expected")
sys.exit(1 if bad else 0)
EOF
then ok "results.json"; else bad "results.json"; fi
grep -q -- "--clock-control none" "$STANDIN/ncu.args" 2>/dev/null && ok "ncu asked to leave the clocks alone" ||
  bad "ncu's arguments lack --clock-control none: $(cat "$STANDIN/ncu.args" 2>/dev/null || echo 'ncu not called')"
n=$(find "$OUT" -type f | wc -l)
[ "$n" -le 8 ] && ok "$n files in GPU_CHECK_OUT (<= 8)" || bad "$n files in GPU_CHECK_OUT: $(ls "$OUT")"
grep -q "== ctest" "$OUT/gpu-check.log" && [ -s "$OUT/gpt2.out" ] && ok "log and stage outputs written" ||
  bad "log or stage outputs missing"

# one line each, non-zero exit: no GPU (no nvidia-smi), a bundle that is not there
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
mkdir -p "$TMP/bin"
for t in bash env dirname cat date mkdir mv rm tee grep sed awk uname getconf nproc cut head tail sort wc tr; do
  p=$(command -v $t) && ln -s "$p" "$TMP/bin/$t"
done
o=$(PATH=$TMP/bin BUILD=$TMP/b GPU_CHECK_OUT=$TMP/o bash "$ROOT/tools/gpu-check" 2>&1); rc=$?
echo "$o" | grep -qx "gpu-check: no GPU: nvidia-smi is not installed" && [ $rc = 3 ] && ok "no GPU: one line, exit 3" ||
  bad "no GPU: exit $rc: $(echo "$o" | tail -2)"
o=$(BUILD=$TMP/b2 GPU_CHECK_OUT=$TMP/o2 "$ROOT/tools/gpu-check" --emulate --bundle "$TMP/none" 2>&1); rc=$?
echo "$o" | grep -q "^gpu-check: missing: bundle .* has no fsdp-gpu-bundle.tar.xz" && [ $rc = 2 ] &&
  ok "missing bundle: one line, exit 2" || bad "missing bundle: exit $rc: $(echo "$o" | tail -2)"
echo "$pass passed, $fail failed"
[ $fail = 0 ]
