#!/usr/bin/env bash
# The device checks, in one run on a CUDA machine without network access:
#   1. terarec's missing dependencies installed from wheels (no index); terarec itself
#      runs from this checkout (PYTHONPATH=src, nothing installed over another copy);
#   2. the CUDA tests (pytest -m gpu, and the device-tier tests, CPU and CUDA cases);
#   3. one CLI run with --device cuda --device-budget (checkpoint, export path);
#   4. benchmarks/gpu_throughput.py on the GPU.
# Each step appends one JSON line to OUT/gpu_check.jsonl; logs go next to it.
#
# Usage: bash benchmarks/gpu_check.sh OUT_DIR [WHEEL_DIR]
#   WHEEL_DIR (default: benchmarks/wheels): wheels for whatever the machine lacks, built
#   for its Python (3.12) beforehand, e.g.
#   pip download --only-binary=:all: --python-version 3.12 -d benchmarks/wheels <pkgs>
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: gpu_check.sh OUT_DIR [WHEEL_DIR]}
WHEELS=${2:-benchmarks/wheels}
mkdir -p "$OUT"
LOG="$OUT/gpu_check.jsonl"
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export PIP_DISABLE_PIP_VERSION_CHECK=1

line() {  # line STEP RC [EXTRA-JSON-FIELDS]
    printf '{"step": "%s", "rc": %s%s}\n' "$1" "$2" "${3:+, $3}" | tee -a "$LOG"
}

# 1. dependencies: import each runtime module terarec needs; install the missing ones.
missing=$("$PY" - <<'EOF'
import importlib
mods = {"numpy": "numpy", "numba": "numba", "pyarrow": "pyarrow", "sklearn": "scikit-learn",
        "tqdm": "tqdm", "matplotlib": "matplotlib", "safetensors": "safetensors",
        "fsspec": "fsspec", "duckdb": "duckdb", "fastapi": "fastapi", "uvicorn": "uvicorn",
        "prometheus_client": "prometheus-client", "pydantic": "pydantic", "optuna": "optuna",
        "msgspec": "msgspec", "orjson": "orjson", "redis": "redis",
        "pytest": "pytest", "pytest_timeout": "pytest-timeout", "hypothesis": "hypothesis"}
out = []
for mod, pkg in mods.items():
    try:
        importlib.import_module(mod)
    except Exception:
        out.append(pkg)
print(" ".join(out))
EOF
)
rc=0
if [ -n "$missing" ]; then
    if [ -d "$WHEELS" ]; then
        "$PY" -m pip install --no-index --find-links "$WHEELS" $missing >"$OUT/pip.log" 2>&1
        rc=$?
    else
        rc=2
        echo "no wheel folder $WHEELS for: $missing" >"$OUT/pip.log"
    fi
fi
cuda=$("$PY" -c "import torch; print(torch.cuda.is_available())" 2>/dev/null || echo False)
line install "$rc" "\"missing\": \"$missing\", \"cuda\": \"$cuda\", \"torch\": \"$("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null)\""

# 2. the CUDA tests (skipped without CUDA) and the device tier's CPU tests beside them.
"$PY" -m pytest -q -p no:cacheprovider -m gpu tests >"$OUT/pytest_gpu.log" 2>&1
rc=$?
line pytest_gpu "$rc" "\"summary\": \"$(tail -n 1 "$OUT/pytest_gpu.log" | tr -d '"')\""
"$PY" -m pytest -q -p no:cacheprovider tests/embedding/test_device_cache.py \
    tests/embedding/test_working_set.py >"$OUT/pytest_device.log" 2>&1
rc=$?
line pytest_device "$rc" "\"summary\": \"$(tail -n 1 "$OUT/pytest_device.log" | tr -d '"')\""

# 3. the CLI on the GPU: train with a device budget, checkpoints and all.
work=$(mktemp -d)
"$PY" -m terarec synth --rows 60000 --out "$work/train.tsv" --valid-rows 10000 \
    --valid-out "$work/valid.tsv" >"$OUT/cli.log" 2>&1 \
  && "$PY" -m terarec train --train "$work/train.tsv" --valid "$work/valid.tsv" \
    --out "$work/model" --device cuda --device-budget 8MB --pass-rows 20000 \
    --batch-size 4096 --no-progress >>"$OUT/cli.log" 2>&1
rc=$?
line cli_train_cuda "$rc" "\"last\": \"$(grep -m1 auc "$OUT/cli.log" | tr -d '"' | head -c 300)\""
rm -rf "$work"

# 4. the benchmark: its JSON line as it printed it.
timeout 420 "$PY" benchmarks/gpu_throughput.py --device cuda --rows 1966080 \
    --pass-batches 30 --passes 3 --steps 50 >"$OUT/gpu_throughput.jsonl" \
    2>"$OUT/gpu_throughput.log"
rc=$?
line gpu_throughput "$rc"
cat "$OUT/gpu_throughput.jsonl" >>"$LOG"
