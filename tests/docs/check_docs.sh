#!/usr/bin/env bash
# The documents that say where things stand stay true to the tree:
# - every figure the README quotes next to a link to docs/performance.md or
#   docs/gpu.md appears in that page;
# - those pages stay short (at most 150 lines) and the old notebooks stay gone;
# - every FSDP_* environment variable read anywhere is in docs/environment.md.
# Usage: check_docs.sh SOURCE_DIR
set -uo pipefail
root=${1:-.}
cd "$root" || exit 2
fail=0
bad() { echo "check_docs: $*" >&2; fail=1; }

for page in docs/performance.md docs/gpu.md; do
  [[ -f $page ]] || { bad "$page is missing"; continue; }
  n=$(wc -l < "$page")
  (( n <= 150 )) || bad "$page has $n lines (at most 150: move dated write-ups to docs/notes/)"
done
for old in BENCHMARKS.md GPU_STATUS.md; do
  [[ -e $old ]] && bad "$old is back at the top level (figures go in docs/performance.md, docs/gpu.md)"
done

# A number with a unit: 805 ms/step, 1.39 x, 6.3-22.0 MB/s, 47.9%, 1.3 microseconds.
unit='(ms/step|s/step|ms|s|MB/s|GB/s|GB|MiB|x|%|microseconds?|us)'
figure="[0-9]+(\.[0-9]+)?(-[0-9]+(\.[0-9]+)?)? ?$unit([^A-Za-z0-9]|$)"
checked=0
while IFS= read -r -d '' para; do
  pages=()
  [[ $para == *docs/performance.md* ]] && pages+=(docs/performance.md)
  [[ $para == *docs/gpu.md* ]] && pages+=(docs/gpu.md)
  (( ${#pages[@]} )) || continue
  while read -r fig; do
    [[ -n $fig ]] || continue
    for num in $(grep -oE '[0-9]+(\.[0-9]+)?' <<< "$fig"); do
      checked=$((checked + 1))
      re="(^|[^0-9.])${num//./\\.}([^0-9]|\.[^0-9]|\$)"
      found=0
      for p in "${pages[@]}"; do grep -qE "$re" "$p" && found=1; done
      (( found )) || bad "README quotes $num (in \"$fig\") but ${pages[*]} does not carry it"
    done
  done < <(grep -oE "$figure" <<< "$para")
done < <(awk 'BEGIN { RS = ""; ORS = "\0" } { print }' README.md)
(( checked > 0 )) || bad "found no figure quoted next to docs/performance.md in README.md (the check reads nothing)"

# FSDP_* variables read: string literals in code, $VAR in scripts, $ENV{VAR} in CMake.
# Names that are C constants of the public header are not variables.
vars=$( {
  grep -rhoE '"FSDP_[A-Z0-9_]+' --include=*.c --include=*.h --include=*.cu --include=*.cpp --include=*.lua \
    engine lua launcher tools tests recipes | tr -d '"'
  grep -rhoE '\$\{?FSDP_[A-Z0-9_]+' --exclude=CMakeLists.txt --exclude=*.cmake engine lua launcher tools tests recipes .ci |
    tr -d '${'
  grep -rhoE 'ENV\{FSDP_[A-Z0-9_]+' --include=CMakeLists.txt --include=*.cmake . | sed 's/ENV{//'
} | sort -u)
for v in $vars; do
  grep -qE "\b$v\b *(=|,)" engine/include/fsdp.h && continue
  grep -qF "\`$v\`" docs/environment.md || bad "$v is read but not listed in docs/environment.md"
done
[[ -n $vars ]] || bad "found no FSDP_* variable in the sources (the check reads nothing)"

# Comments that point into docs/DESIGN.md point at what is there: a section
# by its heading, a decision by its number.
ndec=$(grep -cE '^[0-9]+\. \*\*' docs/DESIGN.md)
while IFS= read -r ref; do
  where=${ref%%:*}; what=${ref#*DESIGN.md, }
  if [[ $what == \"* ]]; then
    name=${what#\"}; name=${name%%\"*}
    grep -qxF "## $name" docs/DESIGN.md || bad "$where points at DESIGN.md section \"$name\", which does not exist"
  else
    for n in $(grep -oE '[0-9]+' <<< "$what"); do
      (( n >= 1 && n <= ndec )) || bad "$where points at DESIGN.md decision $n (there are $ndec)"
    done
  fi
done < <(grep -rnoE 'DESIGN\.md, ("[^"]+"|decisions? [0-9]+( and [0-9]+)?)' engine lua launcher tools tests recipes)

if (( fail )); then exit 1; fi
echo "check_docs: README figures ($checked numbers), page lengths and $(wc -w <<< "$vars") variables checked"
