#!/usr/bin/env bash
# Set up (idempotent) and run the test suite: everything except the long real-model tests, plus the real-model
# smoke test. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# -P: keep the repository root off sys.path, so its kernels/ folder is never importable as a top-level `kernels`
# (a name transformers probes for); the code is installed as aaren_hf.kernels.
exec .venv/bin/python -P -m pytest -m "not slow or smoke" "$@"
