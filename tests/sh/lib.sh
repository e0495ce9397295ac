# Shared by the shell tests, sourced after `set -u`:
#   source "$(dirname "${BASH_SOURCE[0]}")/lib.sh" "$@"
# The arguments are LAUNCHER ROOT: L and ROOT are set, the working folder is
# ROOT, TMP is a fresh folder removed on exit. Each check counts through ok
# or bad; `finish` prints the count and fails when a check failed or none ran.
L=${1:?usage: $(basename "$0") <launcher> <repo root>}
ROOT=${2:?usage: $(basename "$0") <launcher> <repo root>}
cd "$ROOT" || exit 1
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

pass=0 fail=0
ok() { pass=$((pass + 1)); }
# bad NAME [OUTPUT]
bad() { fail=$((fail + 1)); echo "FAIL: $1"; [ -n "${2:-}" ] && printf '  output was:\n%s\n' "$2"; }
# has / hasnt NAME OUTPUT TEXT: OUTPUT holds TEXT (a fixed string), or does not
has() { if grep -qF -- "$3" <<<"$2"; then ok; else bad "$1: no '$3'" "$2"; fi; }
hasnt() { if grep -qF -- "$3" <<<"$2"; then bad "$1: unexpected '$3'" "$2"; else ok; fi; }
# line NAME OUTPUT TEXT: one whole line of OUTPUT is TEXT
line() { if grep -qxF -- "$3" <<<"$2"; then ok; else bad "$1: no line '$3'" "$2"; fi; }
# code NAME GOT WANT: an exit status
code() { if [ "$2" -eq "$3" ]; then ok; else bad "$1: exit code $2, expected $3"; fi; }
# same NAME A B: two strings are equal
same() { if [ "$2" == "$3" ]; then ok; else bad "$1: '$2' vs '$3'"; fi; }
finish() { echo "$pass passed, $fail failed"; [ "$fail" -eq 0 ] && [ "$pass" -gt 0 ]; exit $?; }
