#!/usr/bin/env bash
# The REPL, driven through a pipe and through a pseudo-terminal.
#   bash tests/sh/test_repl.sh <launcher> <repo root>
set -u
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh" "$@"
export OPENBLAS_NUM_THREADS=1 HOME="$TMP"   # history goes to the temp folder

# tensors are made on the engine's default device (cuda where a GPU is)
DEV=$("$L" -e 'io.write(require("fsdp").default_device())' 2>/dev/null)

# ---- through a pipe: no prompts, one result per input ----
out=$(cat <<'EOF' | "$L" 2>&1
1+2
fsdp.tensor({1, 2, 3}) * 2
error("boom")
40 + 2
fsdp.ones(2, 3):matmul(fsdp.ones(4, 5))
"still alive"
for i = 1, 3 do
  io.write(i, ";")
end
print()
function sq(x)
  return x * x
end
sq(7)
local s = [[a
b]] print(#s * 10)
{1, 2, name = "x"}
1, nil, "three"
x = 5
x
t = fsdp.zeros(2, 2)
t:fill(3):sum()
exit()
print("not reached")
EOF
)
rc=$?
[ $rc -eq 0 ] && ok || bad "REPL exits 0 (got $rc)" "$out"
line "1+2 prints 3" "$out" "3"
has "tensor expression values" "$out" " 2  4  6"
has "tensor expression footer" "$out" "[f32 tensor of shape (3) on $DEV]"
has "error message" "$out" "stdin:1: boom"
has "error traceback" "$out" "stack traceback"
line "the line after an error evaluates" "$out" "42"
has "engine error message" "$out" "fsdp_matmul"
line "the line after an engine error evaluates" "$out" "still alive"
line "multi-line for block" "$out" "1;2;3;"
line "multi-line function" "$out" "49"
line "multi-line long string" "$out" "30"
line "tables print readably" "$out" '{1, 2, name = "x"}'
line "multiple results" "$out" $'1\tnil\tthree'
line "globals persist" "$out" "5"
line "method chain" "$out" "12"
hasnt "exit() stops the loop" "$out" "not reached"
hasnt "no prompt when not a terminal" "$out" "fsdp> "

# syntax errors do not end the loop either
out=$(printf 'x = = 1\nprint("after")\n' | "$L" 2>&1)
has "syntax error reported" "$out" "stdin:1:"
line "the line after a syntax error evaluates" "$out" "after"

# a SIGINT whose hook fires just after the chunk returned (a C function the
# chunk tail-calls raises it): the chunk counts as interrupted, the loop goes on
out=$(printf 'ffi = require "ffi" ffi.cdef "int raise(int sig);"\nreturn ffi.C.raise(2)\nprint("after" .. "_stray")\n' | "$L" 2>&1); rc=$?
[ $rc -eq 0 ] && ok || bad "a stray interrupt after a chunk does not end the REPL (got $rc)" "$out"
line "a stray interrupt after a chunk: reported" "$out" "interrupted"
line "a stray interrupt after a chunk: the next chunk runs" "$out" "after_stray"

# Ctrl-D in the middle of a block: exits quietly
out=$(printf 'for i = 1, 2 do\n' | "$L" 2>&1); rc=$?
[ $rc -eq 0 ] && ok || bad "EOF inside a block exits 0 (got $rc)" "$out"

# quit(3) sets the exit code
printf 'quit(3)\n' | "$L" >/dev/null 2>&1; rc=$?
[ $rc -eq 3 ] && ok || bad "quit(3) exits 3 (got $rc)"

# ---- through a pseudo-terminal: prompts, readline, history ----
PY=/usr/bin/python3
[ -x "$PY" ] || PY=$(command -v python3 || true)
if [ -n "$PY" ]; then
  out=$("$PY" - "$L" "$DEV" <<'EOF' 2>&1
import os, pty, select, subprocess, sys, time

launcher, device = sys.argv[1], sys.argv[2]
master, slave = pty.openpty()
proc = subprocess.Popen([launcher], stdin=slave, stdout=slave, stderr=slave, close_fds=True)
os.close(slave)
buf = b""

def expect(text, timeout=20):
    global buf
    end = time.time() + timeout
    while text.encode() not in buf:
        left = end - time.time()
        if left <= 0:
            print("TIMEOUT waiting for %r; got %r" % (text, buf.decode(errors="replace")))
            proc.kill()
            sys.exit(1)
        r, _, _ = select.select([master], [], [], left)
        if r:
            try:
                chunk = os.read(master, 4096)
            except OSError:
                chunk = b""
            if not chunk:
                continue
            buf += chunk
    i = buf.index(text.encode()) + len(text)
    seen, buf = buf[:i], buf[i:]
    return seen.decode(errors="replace")

expect("fsdp> ")
print("PROMPT_OK")
os.write(master, b"20 + 22\n")
expect("42")
print("EXPR_OK")
expect("fsdp> ")
os.write(master, b"for i = 1, 2 do\n")
expect(">> ")
print("CONTINUATION_OK")
os.write(master, b"io.write(i * 100, ' ') end\n")
expect("100 200")
print("BLOCK_OK")
expect("fsdp> ")
os.write(master, b"fsdp.ones(2) + 1\n")
expect("[f32 tensor of shape (2) on %s]" % device)
print("TENSOR_OK")
expect("fsdp> ")
os.write(master, b"error('oops')\n")
expect("stack traceback")
expect("fsdp> ")
os.write(master, b"1 + 1\n")
expect("2")
print("SURVIVES_OK")
expect("fsdp> ")
os.write(master, b"\x04")   # Ctrl-D
try:
    proc.wait(timeout=20)
except subprocess.TimeoutExpired:
    proc.kill()
    print("NO_EXIT")
    sys.exit(1)
print("EXIT_%d" % proc.returncode)
EOF
)
  for s in PROMPT_OK EXPR_OK CONTINUATION_OK BLOCK_OK TENSOR_OK SURVIVES_OK EXIT_0; do
    has "pty: $s" "$out" "$s"
  done
  # with readline, the history is saved (best effort: only checked when built with it)
  if nm -D "$L" 2>/dev/null | grep -q fsdp_repl_readline; then
    if [ -f "$TMP/.fsdp_lua_history" ] && grep -qF "20 + 22" "$TMP/.fsdp_lua_history"; then ok; else bad "history saved to ~/.fsdp_lua_history"; fi
  fi
else
  echo "note: no python3; skipping the pseudo-terminal checks"
fi

# ---- Ctrl-C, Tab completion, help(): one rank, through a pseudo-terminal ----
if [ -n "$PY" ] && nm -D "$L" 2>/dev/null | grep -q fsdp_repl_readline; then
  cat > "$TMP/one.steps" <<'EOF'
expect fsdp> 
# Ctrl-C stops a running chunk (an endless loop) and the REPL goes on
send io.write("loop", "ing\\n") io.flush() while true do end\n
expect looping
sleep 0.2
send \x03
expect interrupted
expect fsdp> 
send 1 + 1\n
expect 2
expect fsdp> 
# Ctrl-C at the prompt drops the half-typed line
send abc def
expect abc def
sleep 0.2
send \x03
expect ^C
send 20 + 1\n
expect 21
expect fsdp> 
# Tab completes globals, fields and methods
send my_unique_value = 5\n
expect fsdp> 
send my_uni\t * 2\n
expect 10
expect fsdp> 
send tbl = {alpha_field = 7}\n
expect fsdp> 
send tbl.alp\t + 1\n
expect 8
expect fsdp> 
send t = fsdp.ones(3)\n
expect fsdp> 
send t:nume\t()\n
expect 3
expect fsdp> 
# help(f) prints the comment above a function's definition
send help(require("fsdp.tokenizer").gpt2)\n
expect Without an argument: $FSDP_GPT2_TOKENIZER
expect fsdp> 
send \x04
wait 0
EOF
  out=$("$PY" tests/sh/repl_pty.py "$TMP/one.steps" -- "$L" 2>&1)
  has "pty, 1 rank: Ctrl-C, completion, help" "$out" "ALL_OK"
  if grep -qxF "t:numel()" "$TMP/.fsdp_lua_history"; then ok; else bad "completed method kept in history" "$(cat "$TMP/.fsdp_lua_history")"; fi
fi

# ---- the REPL across 2 ranks, through a pseudo-terminal ----
MPIRUN=$(command -v mpirun || true)
if [ -n "$PY" ] && [ -n "$MPIRUN" ]; then
  cat > "$TMP/two.steps" <<'EOF'
expect 2 ranks
expect fsdp> 
# every rank runs each chunk (fsdp.shard needs them all)
send nn = require "fsdp.nn"\n
expect fsdp> 
send s = fsdp.shard(nn.Linear(4, 4))\n
expect fsdp> 
send fsdp.rank() + 40\n
expect 40
expect fsdp> 
# errors name the ranks; every rank goes on
send error("everywhere")\n
expect [all ranks] stdin:1: everywhere
expect fsdp> 
send if fsdp.rank() == 1 then error("only on one") end\n
expect [rank 1] stdin:1: only on one
expect fsdp> 
send x = fsdp.rank() * 10 + 1\n
expect fsdp> 
send x + 0\n
expect 1
expect fsdp> 
send s(fsdp.ones(2, 4)):sum():backward() print("backward" .. "_ok")\n
expect backward_ok
expect fsdp> 
# a rank that fails while another waits in a collective: both are told,
# the collective nobody will join is cancelled, and every rank goes on in
# step: a forward and backward afterwards give what they gave before
send m = nn.MLP(4) s2 = fsdp.shard(m)\n
expect fsdp> 
send s2:zero_grad() y0 = m(fsdp.ones(2, 4)):sum() y0:backward() g0 = s2:grad_norm()\n
expect fsdp> 
send if fsdp.rank() == 1 then error("left early") end s3 = fsdp.shard(nn.Linear(4, 4))\n
expect [rank 0]
expect will not join it: stdin:1: left early
expect [rank 1] stdin:1: left early
expect fsdp> 
send y = m(fsdp.ones(2, 4)):sum() if fsdp.rank() == 0 then error("no backward") end y:backward()\n
expect [rank 0] stdin:1: no backward
expect [rank 1]
expect will not join it
expect tape was cleared
expect fsdp> 
send if fsdp.rank() == 0 then error("r0") end fsdp.distributed.barrier()\n
expect [rank 0] stdin:1: r0
expect fsdp> 
send s2:zero_grad() y1 = m(fsdp.ones(2, 4)):sum() y1:backward() g1 = s2:grad_norm()\n
expect fsdp> 
send print(y1:item() == y0:item() and g1 == g0 and g0 > 0 and "same" .. "_after")\n
expect same_after
expect fsdp> 
# a chunk that fails on one rank under no_grad in the middle of a forward
# (inside the second unit's forward, after its gather): that unit stays
# gathered on that rank only, unless every rank reshards after the rejoin;
# the next forward and backward then give what they gave before
send m4 = nn.MLP(4) local lf = m4.c_proj.forward m4.c_proj.forward = function(mod, x) if FAIL_MID and fsdp.rank() == 1 then error("mid-forward") end return lf(mod, x) end s4 = fsdp.shard(m4, { policy = fsdp.policy.by_type("Linear") })\n
expect fsdp> 
send s4:zero_grad() z0 = m4(fsdp.ones(3, 4)):sum() z0:backward() h0 = s4:grad_norm()\n
expect fsdp> 
send FAIL_MID = true fsdp.no_grad(function() return m4(fsdp.ones(3, 4)) end)\n
expect [rank 1] stdin:1: mid-forward
expect fsdp> 
send FAIL_MID = false s4:zero_grad() z1 = m4(fsdp.ones(3, 4)):sum() z1:backward() h1 = s4:grad_norm()\n
expect fsdp> 
send print(z1:item() == z0:item() and h1 == h0 and h0 > 0 and "same" .. "_after_no_grad")\n
expect same_after_no_grad
expect fsdp> 
send fsdp.distributed.sum(fsdp.rank() + 1)\n
expect 3
expect fsdp> 
# Ctrl-C: mpirun would end the job on SIGINT, so rank 0 takes the key from
# the terminal while the REPL runs; it stops a chunk on every rank, even
# one where the other rank waits in a collective, and drops a typed line
isig off
send io.write("loop", "ing", fsdp.rank(), "\\n") io.flush() while true do end\n
expect looping1
sleep 0.3
send \x03
expect [all ranks] interrupted
expect fsdp> 
send if fsdp.rank() == 0 then io.write("spin", "ning\\n") io.flush() while true do end end fsdp.distributed.barrier()\n
expect spinning
sleep 0.3
send \x03
expect [rank 0] interrupted
expect fsdp> 
send abc def
expect abc def
sleep 0.2
send \x03
expect fsdp> 
send fsdp.distributed.sum(fsdp.rank() + 20)\n
expect 41
expect fsdp> 
send \x04
wait 0
isig on
EOF
  out=$(FSDP_NUM_THREADS=1 timeout 200 "$PY" tests/sh/repl_pty.py "$TMP/two.steps" -- \
        "$MPIRUN" --allow-run-as-root --oversubscribe --mca btl self,vader -np 2 "$L" 2>&1)
  has "pty, 2 ranks: chunks on every rank, errors by rank, no hang" "$out" "ALL_OK"

  # when the ranks are not to bring their collectives back in step
  # (FSDP_REPL_REJOIN_SECONDS=0), the job ends with rank 0's message
  out=$(printf 'if fsdp.rank() == 1 then error("left early") end fsdp.distributed.barrier()\nprint("not reached")\n' |
        FSDP_REPL_REJOIN_SECONDS=0 FSDP_NUM_THREADS=1 timeout 120 "$MPIRUN" --allow-run-as-root --oversubscribe \
        --mca btl self,vader -np 2 "$L" 2>&1)
  rc=$?
  [ $rc -ne 0 ] && [ $rc -ne 124 ] && ok || bad "a job the REPL ends exits non-zero, without hanging (got $rc)" "$out"
  has "the REPL ends the job: the failure" "$out" "[rank 1] stdin:1: left early"
  has "the REPL ends the job: its message" "$out" "could not bring their collectives back in step"
  hasnt "the REPL ends the job: no later chunk" "$out" "not reached"
  out=$(printf 'x = =\n' | FSDP_REPL_REJOIN_SECONDS=soon FSDP_NUM_THREADS=1 timeout 120 "$MPIRUN" \
        --allow-run-as-root --oversubscribe --mca btl self,vader -np 2 "$L" 2>&1)
  has "FSDP_REPL_REJOIN_SECONDS checked" "$out" "FSDP_REPL_REJOIN_SECONDS=soon: expected a number of seconds >= 0"

  # the terminal comes back as it was when rank 0 dies, and Ctrl-\ ends the job
  cat > "$TMP/kill.steps" <<'EOF'
expect fsdp> 
isig off
send if fsdp.rank() == 0 then os.execute("kill -9 $PPID") end\n
wait nonzero
isig on
EOF
  out=$(FSDP_NUM_THREADS=1 timeout 120 "$PY" tests/sh/repl_pty.py "$TMP/kill.steps" -- \
        "$MPIRUN" --allow-run-as-root --oversubscribe --mca btl self,vader -np 2 "$L" 2>&1)
  has "pty, 2 ranks: rank 0 killed, the terminal restored" "$out" "ALL_OK"
  cat > "$TMP/quit.steps" <<'EOF'
expect fsdp> 
send \x1c
expect ending the job
wait nonzero
isig on
EOF
  out=$(FSDP_NUM_THREADS=1 timeout 120 "$PY" tests/sh/repl_pty.py "$TMP/quit.steps" -- \
        "$MPIRUN" --allow-run-as-root --oversubscribe --mca btl self,vader -np 2 "$L" 2>&1)
  has "pty, 2 ranks: Ctrl-\\ ends the job" "$out" "ALL_OK"

  # the guard starts with the job's environment (where the libraries come
  # from LD_LIBRARY_PATH it could not start without it); a guard that is
  # gone does not end rank 0 (SIGPIPE) when the REPL ends
  cat > "$TMP/guard.steps" <<'EOF'
expect fsdp> 
isig off
send if fsdp.rank() == 0 then os.execute([[for c in $(pgrep -P $PPID); do if tr '\\0' '\\n' < /proc/$c/environ | grep -qx FSDP_REPL_TERMINAL_GUARD=1; then tr '\\0' '\\n' < /proc/$c/environ | sed -n 's/^FSDP_TEST_GUARD_ENV=/guard_env:/p'; fi; done]]) end\n
expect guard_env:seen
expect fsdp> 
send if fsdp.rank() == 0 then os.execute([[for c in $(pgrep -P $PPID); do tr '\\0' '\\n' < /proc/$c/environ | grep -qx FSDP_REPL_TERMINAL_GUARD=1 && kill -9 $c; done; echo guard_"gone"]]) end\n
expect guard_gone
expect fsdp> 
send \x04
wait 0
isig on
EOF
  out=$(FSDP_TEST_GUARD_ENV=seen FSDP_NUM_THREADS=1 timeout 120 "$PY" tests/sh/repl_pty.py "$TMP/guard.steps" -- \
        "$MPIRUN" --allow-run-as-root --oversubscribe --mca btl self,vader -np 2 "$L" 2>&1)
  has "pty, 2 ranks: the guard has the job's environment; rank 0 outlives a dead guard" "$out" "ALL_OK"

  # the same on one rank of two: that rank stays in the loop, in step
  out=$(printf 'ffi = require "ffi" ffi.cdef "int raise(int sig);"\nif fsdp.rank() == 1 then return ffi.C.raise(2) end\nprint("after" .. "_stray", fsdp.distributed.sum(fsdp.rank() + 1))\n' |
        FSDP_NUM_THREADS=1 timeout 120 "$MPIRUN" --allow-run-as-root --oversubscribe --mca btl self,vader -np 2 "$L" 2>&1)
  rc=$?
  [ $rc -eq 0 ] && ok || bad "2 ranks: a stray interrupt after a chunk on rank 1 does not end the job (got $rc)" "$out"
  line "2 ranks: a stray interrupt after a chunk: reported" "$out" "[rank 1] interrupted"
  n=$(grep -cxF "$(printf 'after_stray\t3')" <<<"$out")
  [ "$n" -eq 2 ] && ok || bad "2 ranks: a stray interrupt after a chunk: both ranks go on (got $n)" "$out"

  # through a pipe: the example that used to hang
  out=$(printf 'nn = require "fsdp.nn"\nm = nn.Linear(4,4)\ns = fsdp.shard(m)\nprint("sharded")\n' |
        FSDP_NUM_THREADS=1 timeout 120 "$MPIRUN" --allow-run-as-root --oversubscribe --mca btl self,vader -np 2 "$L" 2>&1)
  rc=$?
  [ $rc -eq 0 ] && ok || bad "2 ranks through a pipe exit 0 (got $rc)" "$out"
  n=$(grep -cxF "sharded" <<<"$out")
  [ "$n" -eq 2 ] && ok || bad "both ranks ran the chunks (got $n)" "$out"
else
  bad "python3 and mpirun are needed for the REPL tests across ranks"
fi

finish
