#!/bin/sh
# Planner speed: plan bench/plan/speed.toml (1 h at 50 req/s, three candidates, 1-64 servers)
# with the release build, three times; prints the wall time of each run.
set -e
cd "$(dirname "$0")/../.."
cargo build --release --locked --bin sluice >/dev/null
bin="${CARGO_TARGET_DIR:-target}/release/sluice"
for i in 1 2 3; do
  /usr/bin/time -f "run $i: %e s wall, %U s user" "$bin" plan bench/plan/speed.toml --quiet >/dev/null
done
"$bin" plan bench/plan/speed.toml --quiet
