#!/usr/bin/env bash
# lua/fsdp/cdef.lua and lua/fsdp/repl_cdef.lua must be what
# tools/dev/gen_binding.lua makes from engine/include/fsdp.h and
# launcher/fsdp_repl.h (DESIGN.md, decision 1: no hand-kept copy).
#   bash tests/sh/test_binding_drift.sh <launcher> <repo root>
set -u
L=${1:?usage: test_binding_drift.sh <launcher> <repo root>}
ROOT=${2:?usage: test_binding_drift.sh <launcher> <repo root>}
cd "$ROOT" || exit 1
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

# The generator is plain Lua: luajit when installed, else the launcher.
if command -v luajit >/dev/null 2>&1; then RUN=luajit; else RUN=$L; fi
if ! "$RUN" tools/dev/gen_binding.lua "$TMP/cdef.lua"; then
  echo "FAIL: tools/dev/gen_binding.lua did not run"
  exit 1
fi

if ! diff -u lua/fsdp/cdef.lua "$TMP/cdef.lua"; then
  echo "FAIL: lua/fsdp/cdef.lua is out of date with engine/include/fsdp.h."
  echo "Regenerate it with:  luajit tools/dev/gen_binding.lua   (from the repository root)"
  exit 1
fi

# The REPL's binding, from the launcher's header, the same way.
if ! "$RUN" tools/dev/gen_binding.lua "$TMP/repl_cdef.lua" launcher/fsdp_repl.h; then
  echo "FAIL: tools/dev/gen_binding.lua did not run on launcher/fsdp_repl.h"
  exit 1
fi
if ! diff -u lua/fsdp/repl_cdef.lua "$TMP/repl_cdef.lua"; then
  echo "FAIL: lua/fsdp/repl_cdef.lua is out of date with launcher/fsdp_repl.h."
  echo "Regenerate it with:  luajit tools/dev/gen_binding.lua lua/fsdp/repl_cdef.lua launcher/fsdp_repl.h"
  exit 1
fi

# It must also parse in a fresh LuaJIT (a header construct the FFI cannot
# take shows up here by name, not as every Lua test failing at once).
# (Under the launcher the binding is already loaded, so only with luajit.)
if [ "$RUN" = luajit ] && ! luajit -e 'local ffi = require("ffi") ffi.cdef(dofile("lua/fsdp/cdef.lua"))
    ffi.cdef(dofile("lua/fsdp/repl_cdef.lua"))' 2>&1; then
  echo "FAIL: lua/fsdp/cdef.lua does not parse"
  exit 1
fi
echo "binding up to date"
