#!/usr/bin/env bash
# One entry point for a fresh machine: creates .venv on first use, installs the right
# torch build, installs lazytrain_accel, then runs what was asked.
#   ./dev.sh demo [demo flags]     the main job: `lazytrain demo`
#   ./dev.sh test [pytest flags]   the whole test suite (tests/ and integration_tests/)
#   ./dev.sh test-fast [flags]     the same less the slow tests and those that start processes
#   ./dev.sh lazytrain ...         any CLI command inside the environment
# torch: with an NVIDIA GPU (nvidia-smi lists one) the CUDA build from PyPI; without one,
# torch==${LAZYTRAIN_CPU_TORCH:-2.13.0} (on this project's build machines that release is
# a CPU build lying on disk). An already installed torch is kept either way.
set -euo pipefail
cd "$(dirname "$0")"
venv="${LAZYTRAIN_VENV:-.venv}"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
py="$venv/bin/python"
pip_install() { "$py" -m pip install --quiet --disable-pip-version-check "$@"; }

if ! "$py" -c "import torch" >/dev/null 2>&1; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "dev.sh: NVIDIA GPU found: installing the CUDA build of torch" >&2
    pip_install torch
  else
    echo "dev.sh: no NVIDIA GPU: installing torch==${LAZYTRAIN_CPU_TORCH:-2.13.0}" >&2
    pip_install "torch==${LAZYTRAIN_CPU_TORCH:-2.13.0}"
  fi
fi
stamp="$venv/.lazytrain-installed"
if [ ! -f "$stamp" ] || [ setup.cfg -nt "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  pip_install -e ".[dev]"
  touch "$stamp"
fi

cmd="${1:-help}"
[ $# -gt 0 ] && shift
case "$cmd" in
  demo)
    exec "$venv/bin/lazytrain" demo "$@" ;;
  test|test-fast)
    select="not alone"; alone="alone"
    if [ "$cmd" = test-fast ]; then
      select="not slow and not subprocess and not multirank and not alone"
      alone="not slow and not subprocess and not multirank and alone"
    fi
    # two worker processes (pytest-xdist), each module's tests on one worker (its
    # module-scoped reference runs shared; LAZYTRAIN_TEST_WORKERS=0: all in this process),
    # the longest modules first (tests/conftest.py orders them; xdist keeps that order),
    # then the tests marked `alone` (they compare timings) with the machine to themselves
    set +e
    "$py" -m pytest tests integration_tests -m "$select" \
      -n "${LAZYTRAIN_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder "$@"
    rc=$?
    "$py" -m pytest tests integration_tests -m "$alone" "$@"
    rc_alone=$?
    set -e
    if [ "$rc" -eq 5 ] && [ "$rc_alone" -eq 5 ]; then
      echo "dev.sh: pytest collected no tests: treated as a failure" >&2
      exit 1
    fi
    [ "$rc" -eq 5 ] && rc=0
    [ "$rc_alone" -eq 5 ] && rc_alone=0
    [ "$rc" -ne 0 ] && exit "$rc"
    exit "$rc_alone" ;;
  lazytrain)
    exec "$venv/bin/lazytrain" "$@" ;;
  *)
    sed -n '2,10p' "$0"; exit 2 ;;
esac
