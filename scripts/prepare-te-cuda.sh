#!/usr/bin/env bash
# TransformerEngine for the GPU machine (Python 3.12, torch 2.11.0+cu130, no package index), made on this
# machine: TE's core library as the prebuilt `transformer_engine_cu13` wheel, and its PyTorch extension
# `transformer_engine_torch`, which the package index has only as source, compiled here against that exact
# torch with this machine's nvcc (CUDA 13.0) for Hopper (sm_90). Needs Python 3.12 (pyenv's is used when
# found), CUDA 13's nvcc, ~7 GB under $WORK and about 25 minutes on 2 cores (33 C++ files).
#
#   bash scripts/prepare-te-cuda.sh
#
# Leaves .te-cuda/: p00, p01, ... (<= 57 MB parts of one tar of the wheels: the device takes 64 MiB a call)
# and install.sh. On the device, bring each part but the last to /tmp/tw in its own call
# (`mkdir -p /tmp/tw && cp .te-cuda/p00 /tmp/tw/`, carry .te-cuda/p00; the machine must still be warm),
# then carry the last part and install.sh with the run itself:
#   bash .te-cuda/install.sh && PYTHONPATH=/tmp/te-site:$PYTHONPATH python3 bench/megatron_te.py --json
# (scripts/gpu_transformer_engine.sh does that last call's work).
set -euo pipefail
cd "$(dirname "$0")/.."
TE_VERSION=2.20.2
TORCH_VERSION=2.11.0
WORK=${WORK:-/tmp/vime-te-build}
PY=${PY312:-$(ls /root/.pyenv/versions/3.12.*/bin/python3.12 2>/dev/null | head -1 || true)}
[ -x "${PY:-}" ] || PY=$(command -v python3.12) || { echo "needs Python 3.12 (set PY312)" >&2; exit 2; }
# CUDA's own folder (its include/crt headers), not a wrapper script's: CUDA_HOME, else /usr/local/cuda-13.*
CUDA_HOME=${CUDA_HOME:-$(ls -d /usr/local/cuda-13* 2>/dev/null | head -1)}
[ -x "${CUDA_HOME:-/nonexistent}/bin/nvcc" ] || { echo "needs CUDA 13 (set CUDA_HOME to the folder with bin/nvcc)" >&2; exit 2; }
export CUDA_HOME
mkdir -p "$WORK/wheels" .te-cuda

# A build environment with the device's torch (its CUDA libraries and headers come with it).
[ -x "$WORK/venv/bin/python" ] || "$PY" -m venv "$WORK/venv"
V="$WORK/venv/bin/python"
"$V" -m pip install -q "torch==$TORCH_VERSION" "setuptools<82" wheel packaging pybind11 ninja
"$V" -m pip install -q --no-deps "transformer_engine_cu13==$TE_VERSION"
SP=$("$V" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/nvidia
export PATH="$WORK/venv/bin:$CUDA_HOME/bin:$PATH" NVTE_PYTORCH_FORCE_BUILD=TRUE NVTE_CUDA_ARCHS=90 NVTE_FRAMEWORK=pytorch
export MAX_JOBS=${MAX_JOBS:-2} CPATH="$SP/cu13/include:$SP/nccl/include:$SP/cudnn/include" LIBRARY_PATH="$SP/cu13/lib:$SP/nccl/lib:$SP/cudnn/lib"

# The extension from source, against the environment's torch (no isolated build environment).
"$V" -m pip wheel -q --no-deps --no-build-isolation -w "$WORK/wheels" "transformer_engine_torch==$TE_VERSION"
# The core wheel, TE's Python package (`transformer_engine`: TE refuses to import without its metadata), and
# the pure-Python packages TE imports that the device's image may lack.
"$V" -m pip download -q --no-deps -d "$WORK/wheels" "transformer_engine_cu13==$TE_VERSION" \
  "transformer_engine==$TE_VERSION" einops importlib_metadata zipp

rm -f .te-cuda/p*
tar -C "$WORK/wheels" -cf - . | split -b 57000000 -d - .te-cuda/p
cat > .te-cuda/install.sh <<'EOF'
#!/usr/bin/env bash
# On the GPU machine: join the parts (earlier ones in /tmp/tw, the last one beside this script) and
# install the wheels into /tmp/te-site (no index, no dependencies: torch and its CUDA libraries are there).
set -euo pipefail
here=$(dirname "$0")
mkdir -p /tmp/tw /tmp/te-wheels
cp "$here"/p* /tmp/tw/ 2>/dev/null || true
cat /tmp/tw/p* | tar -C /tmp/te-wheels -xf -
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/te-site /tmp/te-wheels/*.whl
echo "transformer_engine installed in /tmp/te-site"
EOF
chmod +x .te-cuda/install.sh
ls -l .te-cuda
