#!/usr/bin/env bash
# The fsdp-lua command line: -e, -l, -i, --help, --version, recipe options,
# usage errors, script errors, exit codes, stdin scripts, the MLP recipe, and
# (when mpirun works here) an uncaught error ending a two-rank job.
#   bash tests/sh/test_cli.sh <launcher> <repo root>
set -u
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh" "$@"
export OPENBLAS_NUM_THREADS=1


# --help / -h
out=$("$L" --help 2>&1); rc=$?
code "--help" $rc 0
for s in "usage: fsdp-lua" "-e CODE" "-l MODULE" "-i " "-v, --version" "-h, --help" "--key=value" "examples:" "mpirun" "docs/environment.md"; do
  has "--help lists $s" "$out" "$s"
done
out=$("$L" -h 2>&1); has "-h" "$out" "usage: fsdp-lua"

# --version / -v
out=$("$L" --version 2>&1); rc=$?
code "--version" $rc 0
has "--version" "$out" "fsdp-lua 0."
has "--version names LuaJIT" "$out" "LuaJIT"
out=$("$L" -v 2>&1); has "-v" "$out" "fsdp-lua 0."

# -e, repeated, in order; fsdp is preloaded for -e code
out=$("$L" -e 'x = 20' -e 'print(x + 1)' -e 'print(fsdp.ones(2):sum():item())' 2>&1); rc=$?
code "-e" $rc 0
[ "$out" = $'21\n2' ] && ok || bad "-e runs in order" "$out"

# -l: require into a global named after the module's last part
out=$("$L" -l fsdp.memory -e 'print(type(memory.stats))' 2>&1)
[ "$out" = "function" ] && ok || bad "-l fsdp.memory" "$out"
out=$("$L" -l fsdp -e 'print(type(fsdp.zeros))' 2>&1)
[ "$out" = "function" ] && ok || bad "-l fsdp" "$out"

# -i: REPL after the -e code / the script
out=$(printf 'x * 2\n' | "$L" -e 'x = 21' -i 2>&1)
has "-i after -e" "$out" "42"
cat >"$TMP/setx.lua" <<'EOF'
y = 5
EOF
out=$(printf 'y + 1\n' | "$L" -i "$TMP/setx.lua" 2>&1)
has "-i after a script" "$out" "6"
# -i after a recipe: the table it returns (the GPT-2 recipe's model, sharded, opt, options) becomes globals
out=$(printf 'print(model.__name, options.steps, #sharded.units, type(opt.step))\n' |
      "$L" -i recipes/gpt2.lua --steps=1 --eval-every=0 --sample=0 2>&1)
has "-i recipe: its objects are globals" "$out" "$(printf 'GPT\t1\t3\tfunction')"
has "-i recipe: says which" "$out" "the recipe left model, opt, options, sharded for the REPL"

# a recipe gets its options as a table, and arg as luajit builds it
cat >"$TMP/opts.lua" <<'EOF'
local opts = ...
print("steps", opts.steps, math.type and math.type(opts.steps) or type(opts.steps))
print("lr", opts.lr + 0)
print("name", opts.name)
print("flag", opts.flag, type(opts.flag))
print("off", opts.off, type(opts.off))
print("nope", opts.verbose)
print("max_steps", opts.max_steps)
print("pos", opts[1], opts[2], #opts)
print("arg", arg[0]:match("opts.lua$") ~= nil, arg[1], arg[2], arg[-1] ~= nil)
EOF
out=$("$L" "$TMP/opts.lua" --steps=10 --lr=0.01 --name=x --flag --off=false --no-verbose pos1 --max-steps=3 pos2 2>&1); rc=$?
code "recipe options" $rc 0
has "number option" "$out" $'steps\t10\tnumber'
has "float option" "$out" $'lr\t0.01'
has "string option" "$out" $'name\tx'
has "flag" "$out" $'flag\ttrue\tboolean'
has "false option" "$out" $'off\tfalse\tboolean'
has "--no-flag" "$out" $'nope\tfalse'
has "dashes become underscores" "$out" $'max_steps\t3'
has "positional args" "$out" $'pos\tpos1\tpos2\t2'
has "arg table" "$out" $'arg\ttrue\t--steps=10\t--lr=0.01\ttrue'

# a script from stdin
out=$(printf 'print("from stdin", (...)[1])\n' | "$L" - hello 2>&1)
has "script from stdin" "$out" $'from stdin\thello'

# usage errors: exit 1 with a clear message
out=$("$L" -x 2>&1); rc=$?
code "unknown option" $rc 1
[ "$out" = "fsdp-lua: unknown option -x (see --help)" ] && ok || bad "unknown option message" "$out"
out=$("$L" -e 2>&1); rc=$?
code "-e without code" $rc 1
has "-e without code" "$out" "-e needs an argument"
out=$("$L" "$TMP/missing.lua" 2>&1); rc=$?
code "missing recipe" $rc 1
has "missing recipe message" "$out" "fsdp-lua: cannot open recipe '$TMP/missing.lua': No such file"

# an uncaught error: rank, message, traceback, exit 1
cat >"$TMP/fails.lua" <<'EOF'
local fsdp = require "fsdp"
local function inner()
  local r = fsdp.ones(2, 3):matmul(fsdp.ones(4, 5))
  return r
end
local r = inner()
EOF
out=$("$L" "$TMP/fails.lua" 2>&1); rc=$?
code "script error" $rc 1
has "script error names the rank" "$out" "fsdp-lua: rank 0: "
has "script error message" "$out" "fsdp_matmul"
has "script error line" "$out" "fails.lua:3:"
has "script error traceback" "$out" "stack traceback"
printf 'x = = 1\n' >"$TMP/syntax.lua"
out=$("$L" "$TMP/syntax.lua" 2>&1); rc=$?
code "syntax error" $rc 1
has "syntax error message" "$out" "syntax.lua:1:"
out=$("$L" -e 'error({})' 2>&1); rc=$?
code "non-string error" $rc 1
has "non-string error" "$out" "error object is a table value"

# exit codes
"$L" -e 'os.exit(3)' >/dev/null 2>&1; code "os.exit(3)" $? 3
"$L" -e 'os.exit(true)' >/dev/null 2>&1; code "os.exit(true)" $? 0
printf 'return 0\n' >"$TMP/ok.lua"
"$L" "$TMP/ok.lua" >/dev/null 2>&1; code "successful script" $? 0

# FSDP_LUA_PATH is searched first
mkdir -p "$TMP/lib"
printf 'return "from FSDP_LUA_PATH"\n' >"$TMP/lib/mymod.lua"
out=$(FSDP_LUA_PATH="$TMP/lib" "$L" -e 'print(require("mymod"))' 2>&1)
[ "$out" = "from FSDP_LUA_PATH" ] && ok || bad "FSDP_LUA_PATH folder" "$out"
out=$(FSDP_LUA_PATH="$TMP/lib/?.lua" "$L" -e 'print(require("mymod"))' 2>&1)
[ "$out" = "from FSDP_LUA_PATH" ] && ok || bad "FSDP_LUA_PATH template" "$out"

# the MLP recipe learns
out=$("$L" recipes/mlp.lua --steps=200 --seed=1 2>&1); rc=$?
code "mlp recipe" $rc 0
first=$(grep -oE 'loss [0-9.]+' <<<"$out" | head -1 | cut -d' ' -f2)
last=$(grep -oE 'loss [0-9.]+' <<<"$out" | tail -1 | cut -d' ' -f2)
if [ -n "$first" ] && [ -n "$last" ] && awk -v f="$first" -v l="$last" 'BEGIN { exit !(l < f / 4) }'; then
  ok
else
  bad "mlp loss falls well below the first (first $first, last $last)" "$out"
fi

# under mpirun (when it works here): ranks, and an error on one rank ends the job
if command -v mpirun >/dev/null 2>&1; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
  out=$(timeout 60 mpirun -np 2 "$L" -e 'print("rank", fsdp.rank(), fsdp.world())' 2>&1); rc=$?
  if [ $rc -eq 0 ] && grep -qF $'rank\t1\t2' <<<"$out"; then
    ok
    out=$(timeout 60 mpirun -np 2 "$L" -e 'if fsdp.rank() == 1 then error("rank one fails") end while true do end' 2>&1); rc=$?
    if [ $rc -ne 0 ] && [ $rc -ne 124 ]; then ok; else bad "mpirun: an error on rank 1 ends the job (exit $rc)" "$out"; fi
    has "mpirun: the failing rank's message" "$out" "fsdp-lua: rank 1: (command line):1: rank one fails"
    # --verbose (or FSDP_VERBOSE=1): one placement line per rank, in rank order, before the script runs
    host=$(hostname)
    for how in --verbose FSDP_VERBOSE=1; do
      if [ "$how" = --verbose ]; then
        out=$(FSDP_NUM_THREADS=1 timeout 60 mpirun -np 3 -x FSDP_NUM_THREADS "$L" --verbose -e 'print("script")' 2>&1)
      else
        out=$(FSDP_VERBOSE=1 FSDP_NUM_THREADS=1 timeout 60 mpirun -np 3 -x FSDP_VERBOSE -x FSDP_NUM_THREADS "$L" \
              -e 'print("script")' 2>&1)
      fi
      # (the device as this build has it: the CPU, or the emulated GPU with its CPU threads)
      got=$(grep '^rank ' <<<"$out" | sed -E 's/, device (cpu \(1 threads\)|cuda:[0-9]+ .*, 1 CPU threads)$/, device D/')
      want=$(for r in 0 1 2; do echo "rank $r of 3 on host $host: local rank $r of 3, device D"; done)
      [ "$got" = "$want" ] && ok || bad "$how: a placement line per rank, in order" "$out"
      [ "$(grep -n script <<<"$out" | head -1 | cut -d: -f1)" -gt 3 ] && ok || bad "$how: the lines come first" "$out"
    done
  else
    echo "note: mpirun does not start here; skipping the two-rank checks"
  fi
fi

finish
