#!/usr/bin/env bash
# Float32 throughput of two commits, one after the other in one run, on this CPU restricted to
# what an AVX2-only CPU has: oneDNN, ATen and MKL limited to AVX2 and our kernels built for
# Zen 3 (-march=znver3, no AVX-512), with the float32 choices an AVX2-only host makes. For an
# AVX-512 host without an AVX2-only one at hand: it measures what changed between the commits on
# the AVX2 code paths, not what host A (Zen 3) would give; the cores, caches and memory are
# still this host's.
#
#   bash benchmarks/avx2_restricted.sh OLD_COMMIT [NEW_COMMIT] [-- bench throughput arguments]
#   bash benchmarks/avx2_restricted.sh 1048301 HEAD -- --workload ../shared/workloads/mixed.jsonl
#
# Each commit is checked out in a temporary worktree (removed at the end), its kernels built in
# a temporary extension folder of its own (~30 s each run), then `pagedllm bench
# throughput --dtype float32 --skip-naive --decode-tokens 0` runs from the repository with the
# arguments given (python -P: the worktree's package, not the checkout's).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
old=${1:?usage: avx2_restricted.sh OLD_COMMIT [NEW_COMMIT] [-- bench throughput arguments]}
shift
new=HEAD
if [[ $# -gt 0 && $1 != "--" ]]; then new=$1; shift; fi
[[ $# -gt 0 && $1 == "--" ]] && shift
args=("$@")
[[ ${#args[@]} -gt 0 ]] || args=(--workload "$repo/../shared/workloads/mixed.jsonl")
work=$(mktemp -d)
cleanup() {
  for tree in "$work"/tree-*; do [[ -d $tree ]] && { git -C "$repo" worktree remove --force "$tree" || true; }; done
  rm -rf "$work"
  git -C "$repo" worktree prune
}
trap cleanup EXIT

export ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2
echo "host: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), restricted to AVX2 (znver3 kernels)"
if [[ $(git -C "$repo" rev-parse "$old") == $(git -C "$repo" rev-parse "$new") ]]; then
  echo "OLD_COMMIT and NEW_COMMIT are the same commit" >&2
  exit 2
fi
for commit in "$old" "$new"; do
  sha=$(git -C "$repo" rev-parse --short "$commit")
  tree=$work/tree-$sha
  git -C "$repo" worktree add --quiet --detach "$tree" "$sha"
  kernel=$tree/pagedllm/kernels/cpu_ops.py
  [[ -f $kernel ]] || kernel=$tree/pagedllm/attention/cpu_kernel.py  # where it was before 7b71f1b
  # our kernels for Zen 3, under their own name; the float32 kernel choices an AVX2-only host makes
  sed -i 's/-march=native/-march=znver3/; s/"pagedllm_cpu/"pagedllm_avx2_restricted/' "$kernel"
  if ! grep -q -- "-march=znver3" "$kernel" || ! grep -q '"pagedllm_avx2_restricted' "$kernel"; then
    echo "$commit: its cpu_kernel.py does not build the way this script expects; not measured" >&2
    exit 1
  fi
  echo "== $commit ($sha)"
  (cd "$repo" && TORCH_EXTENSIONS_DIR=$work/extensions-$sha PYTHONPATH=$tree .venv/bin/python -P -m pagedllm bench throughput \
    --dtype float32 --skip-naive --decode-tokens 0 "${args[@]}")
done
