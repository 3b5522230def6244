#!/usr/bin/env bash
# Instructions per batch of the host backend's hot path (acquire, publish, recv, release on one
# thread: benches/examples/hot_path.rs), counted by valgrind's cachegrind: the same from run to
# run, unlike wall time on a small shared VM. Runs the example with N and 11*N batches and
# reports (count(11N) - count(N)) / 10N, so setup and teardown cancel out.
#
#   bash benches/hot_path.sh                 # this tree
#   bash benches/hot_path.sh 2331253         # this tree, then the same program built at 2331253
#   N=50000 bash benches/hot_path.sh         # more batches (default 20000)
#
# The other commit is checked out in a temporary worktree (removed afterwards) with this
# tree's example copied in; its build goes to target/hot-path-base. Needs valgrind.
set -euo pipefail
cd "$(dirname "$0")/.."
N=${N:-20000}
command -v valgrind >/dev/null || { echo "hot_path.sh: needs valgrind" >&2; exit 2; }

refs() { # BINARY BATCHES -> instructions executed by the whole process
  valgrind --tool=cachegrind --cache-sim=no --cachegrind-out-file=/dev/null "$1" "$2" 2>&1 |
    awk '/I *refs:/ { gsub(",", "", $NF); print $NF }'
}
per_batch() { # LABEL BINARY
  local small large
  small=$(refs "$2" "$N")
  large=$(refs "$2" $((11 * N)))
  if [ -z "$small" ] || [ -z "$large" ]; then
    echo "hot_path.sh: valgrind gave no count for $1" >&2
    exit 1
  fi
  awk -v a="$small" -v b="$large" -v n="$N" -v l="$1" \
    'BEGIN { printf "%-12s %8.1f instructions per batch\n", l, (b - a) / (10 * n) }'
}

cargo build --quiet --release --locked -p gpipe-benches --example hot_path
per_batch "this tree" target/release/examples/hot_path

if [ $# -ge 1 ]; then
  base=$(git rev-parse --short "$1")
  wt=$(mktemp -d /tmp/gpipe-hot-path.XXXXXX)
  trap 'git worktree remove --force "$wt" >/dev/null 2>&1 || true; rm -rf "$wt"' EXIT
  git worktree add --detach --quiet "$wt" "$base"
  mkdir -p "$wt/benches/examples"
  cp benches/examples/hot_path.rs "$wt/benches/examples/"
  # Before HostOptions had fields it was a unit struct without Default.
  if ! grep -q "derive(.*Default" <(grep -B3 "pub struct HostOptions" "$wt"/pipeline-core/src/*.rs); then
    sed -i 's/HostOptions::default()/HostOptions/g' "$wt/benches/examples/hot_path.rs"
  fi
  (cd "$wt" && CARGO_TARGET_DIR="$PWD/../$(basename "$wt")-target" \
    cargo build --quiet --release -p gpipe-benches --example hot_path)
  per_batch "$base" "$wt-target/release/examples/hot_path"
  rm -rf "$wt-target"
fi
