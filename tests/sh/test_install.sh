#!/usr/bin/env bash
# cmake --install into a temporary prefix: the executable, the library, the
# header, the Lua modules and the tokenizer files; the installed fsdp-lua
# runs from elsewhere, finds its own modules (not the source tree's), and
# says its version.
#   bash tests/sh/test_install.sh <launcher> <repo root>
set -u
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh" "$@"
BUILD=$(dirname "$L")

out=$(cmake --install "$BUILD" --prefix "$TMP/prefix" 2>&1) && ok || bad "cmake --install" "$out"
P="$TMP/prefix"
for f in bin/fsdp-lua include/fsdp.h share/fsdp-lua/lua/fsdp/init.lua share/fsdp-lua/lua/fsdp/tokenizer.lua \
         share/fsdp-lua/data/gpt2/encoder.json share/fsdp-lua/data/gpt2/vocab.bpe; do
  [ -f "$P/$f" ] && ok || bad "installed $f"
done
ls "$P"/lib*/libfsdp.so >/dev/null 2>&1 && ok || bad "installed libfsdp.so"

cd "$TMP" || exit 1
unset FSDP_LUA_PATH FSDP_GPT2_TOKENIZER
out=$("$P/bin/fsdp-lua" -e 'io.write(package.searchpath("fsdp.tokenizer", package.path), "\n",
      require("fsdp.tokenizer").gpt2():encode("Hello world")[1], "\n", fsdp.ones(2):sum():item(), "\n")' 2>&1)
grep -qxF "$P/bin/../share/fsdp-lua/lua/fsdp/tokenizer.lua" <<<"$out" && ok || bad "the installed modules are used" "$out"
grep -qxF "15496" <<<"$out" && ok || bad "the installed tokenizer finds its files" "$out"
grep -qxF "2" <<<"$out" && ok || bad "the installed engine runs" "$out"
out=$("$P/bin/fsdp-lua" --version 2>&1); rc=$?
[ $rc -eq 0 ] && grep -q "^fsdp-lua [0-9]" <<<"$out" && ok || bad "installed --version (rc $rc)" "$out"
# from another directory, a recipe by its bare name and its default data: the installed ones
for f in share/fsdp-lua/recipes/gpt2.lua share/fsdp-lua/data/corpus.txt share/fsdp-lua/tools/make_shards.lua \
         share/fsdp-lua/tools/ckpt_info.lua share/fsdp-lua/tools/plot; do
  [ -f "$P/$f" ] && ok || bad "installed $f"
done
out=$("$P/bin/fsdp-lua" gpt2.lua --steps=2 --eval-every=0 --sample=0 --log-every=1 2>&1); rc=$?
[ $rc -eq 0 ] && grep -q "^done: 2 steps" <<<"$out" && ok || bad "fsdp-lua gpt2.lua from another directory (rc $rc)" "$out"
grep -qF "$P/bin/../share/fsdp-lua/data/corpus.txt" <<<"$out" && ok || bad "its default data is the installed text" "$out"
out=$("$P/bin/fsdp-lua" "$P/share/fsdp-lua/tools/make_shards.lua" --help 2>&1); rc=$?
[ $rc -eq 0 ] && grep -q -- "--input" <<<"$out" && ok || bad "the installed make_shards.lua runs (rc $rc)" "$out"
out=$("$P/bin/fsdp-lua" nope.lua 2>&1); rc=$?
[ $rc -ne 0 ] && grep -qF "cannot open recipe 'nope.lua'" <<<"$out" && ok || bad "a recipe found nowhere is named (rc $rc)" "$out"
# moved elsewhere, the prefix still works (everything is relative)
mv "$P" "$TMP/moved"
out=$("$TMP/moved/bin/fsdp-lua" -e 'print(fsdp.ones(3):sum():item())' 2>&1)
grep -qxF "3" <<<"$out" && ok || bad "a moved prefix still runs" "$out"

finish
