#!/usr/bin/env bash
# Set up (idempotent) and run the test suite: everything except the long real-model tests, plus the real-model
# smoke test. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# -P, and PYTHONSAFEPATH for pytest's workers: keep the repository root off sys.path, so its kernels/ folder is never
# importable as a top-level `kernels` (a name transformers probes for); the code is installed as aaren_hf.kernels.
# One worker per core (pytest-xdist; `-n 0` runs in this process), each computing on one thread: on two cores two
# workers of two threads wait on each other's descheduled threads. Each worker starts on a contiguous run of tests
# (a file's module fixtures are mostly built once) and takes the other's last ones when it runs out.
export PYTHONSAFEPATH=1 OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec .venv/bin/python -P -m pytest -n auto --dist worksteal -m "not slow or smoke" "$@"
