#!/usr/bin/env bash
# Set up (idempotent) and run the test suite: everything except the long real-model tests, plus the real-model
# smoke test. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -m "not slow or smoke" "$@"
