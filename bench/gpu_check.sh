#!/usr/bin/env bash
# The prepared GPU check (docs/benchmarks.md, "GPU check"). On the lent H200 machine:
#   bash bench/gpu_check.sh "$OUT"            (carry .whl: pyscipopt, bitsandbytes, peft wheels)
# Here, on a CPU machine, the same path with a tiny model:
#   bash bench/gpu_check.sh OUT_DIR --dry-run
# Wheels: python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#   --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
#   -d .whl pyscipopt==6.3.0 bitsandbytes==0.50.2 peft==0.21.2
# Without peft (a test-only dependency) the QLoRA formats are skipped, said in one line.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:?usage: bench/gpu_check.sh OUT_DIR [--dry-run]}"
shift
if ! python3 -c "import pyscipopt, bitsandbytes, peft" >/dev/null 2>&1; then
  if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/lazytrain_site .whl/*.whl
    export PYTHONPATH="/tmp/lazytrain_site${PYTHONPATH:+:$PYTHONPATH}"
  fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec timeout 470 python3 bench/gpu_check.py "$out" "$@"
