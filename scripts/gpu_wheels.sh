# Sourced by scripts/gpu_smoke.sh and scripts/gpu_bench.sh from the repository root, with their arguments. A GPU
# machine with CUDA and torch but no NIXL, vLLM or SGLang, and no network: the missing wheels travel in
# $GLM_PD_WHEELS (default .whl) and are installed into a private folder ($GLM_PD_SITE); glm_pd_common is read from
# common/ as it lies. With --fetch-wheels (where pip reaches PyPI) it downloads those wheels for the GPU machine's
# Python ($GLM_PD_GPU_PYTHON, default 3.12) and exits.
wheels=${GLM_PD_WHEELS:-.whl}

if [ "${1:-}" = "--fetch-wheels" ]; then
  # numpy is in the GPU image (with torch); NIXL, msgspec, pyzmq, xxhash and pytest may not be (versions as
  # requirements/). The wheels come to ~60 MiB: within a 64 MiB carry, with the tree.
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "${GLM_PD_GPU_PYTHON:-3.12}" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$wheels" nixl==1.5.1 nixl-cu13==1.5.1 msgspec==0.23.0 pyzmq==27.3.0 \
    xxhash==4.1.0
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "${GLM_PD_GPU_PYTHON:-3.12}" \
    -d "$wheels" pytest==9.2.0 pluggy iniconfig packaging pygments
  du -sh "$wheels"
  exit 0
fi

site=${GLM_PD_SITE:-/tmp/glm-pd-site}
mkdir -p "$site"
py=$(python3 -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
if compgen -G "$wheels/msgspec-*.whl" >/dev/null && ! compgen -G "$wheels/msgspec-*-$py-*.whl" >/dev/null; then
  echo "SKIPPED: the wheels in $wheels are not for this machine's Python ($py): fetch them with" \
    "GLM_PD_GPU_PYTHON set to it (--fetch-wheels)"
  exit 77
fi
# installed once per set of wheels (gpu_session.sh sources this three times; NIXL's CUDA wheel alone is ~120 MB)
if compgen -G "$wheels/*.whl" >/dev/null; then
  stamp=$(stat -c '%n %s' "$wheels"/*.whl | sha256sum | cut -d' ' -f1)
  if [ "$(cat "$site/.glm-pd-wheels" 2>/dev/null)" != "$stamp" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
      "$wheels"/*.whl
    echo "$stamp" >"$site/.glm-pd-wheels"
  fi
fi
export PYTHONPATH="$site:$PWD:$PWD/common${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export UCX_PROTO_INFO=${UCX_PROTO_INFO:-y}  # UCX prints the protocol it picks per operation (cuda_ipc, or a fallback)
# One node, one GPU: UCX's InfiniBand module stays unloaded (with the system's RDMA drivers installed, NIXL's bundled
# UCX and the system's libnl crash the process at exit, FACTS.md section 6)
export UCX_MODULES=${UCX_MODULES:-^ib}
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv 2>/dev/null || true
