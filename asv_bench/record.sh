#!/usr/bin/env bash
# Record asv results for COMMITs with an existing Python environment (the one where
# flashcore[bench] and, for the peers, torch and jax are installed), without building
# virtualenvs: each commit is exported with git archive, installed into a scratch
# directory with pip --target, and put first on the benchmark processes' PYTHONPATH.
# The benchmark code (and flashcore/bench/, the runner) is this tree's for every commit.
#
#   usage: asv_bench/record.sh [-m MACHINE] COMMIT... [-- EXTRA ASV RUN ARGS]
#   e.g.   asv_bench/record.sh -m cpu-2core HEAD -- -b ForwardCPU
set -euo pipefail
cd "$(dirname "$0")"
machine=()
if [[ "${1:-}" == "-m" ]]; then machine=(--machine "$2"); shift 2; fi
commits=()
while [[ $# -gt 0 && "$1" != "--" ]]; do commits+=("$1"); shift; done
[[ "${1:-}" == "--" ]] && shift
python=$(command -v "${PYTHON:-python}")
for commit in "${commits[@]}"; do
    hash=$(git rev-parse "${commit}^{commit}")
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    mkdir -p "$work/src"
    git -C .. archive "$hash" | tar -x -C "$work/src"
    "$python" -m pip install --quiet --no-deps --no-build-isolation --target "$work/site" \
        "$work/src"
    echo "== $hash: flashcore from $work/site"
    # (asv hands ASV_PYTHONPATH to the benchmark processes as their PYTHONPATH)
    path="$work/site${PYTHONPATH:+:$PYTHONPATH}"
    PYTHONPATH="$path" ASV_PYTHONPATH="$path" "$python" -m asv run -E "existing:$python" \
        --set-commit-hash "$hash" "${machine[@]}" "$@" || echo "== asv run failed for $hash"
    rm -rf "$work"
    trap - EXIT
done
