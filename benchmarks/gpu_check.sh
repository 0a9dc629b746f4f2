#!/usr/bin/env bash
# One prepared pass on a CUDA machine: the GPU-only tests (compiled Triton kernels against float64 and the PyTorch
# path; the model on CUDA against float64 and its own decode), then the whole model against its teacher
# (bench_model.py: prefill, generate and train steps at the shapes of issue 12, bf16), then the window branch's
# kernels (attention, decode step) against the paths they replaced (bench_window.py) and the scan's kernel benchmark
# at B=1. Runs from a checkout with whatever torch/triton the machine has: the checkout is installed (no dependencies)
# into a folder of its own under LOG_DIR, and Python runs as with -P (PYTHONSAFEPATH), so the repository root is never
# on sys.path and its kernels/ folder cannot pose as the `kernels` package (docs/layout.md).
#
#     bash benchmarks/gpu_check.sh [LOG_DIR]        # logs + bench JSON in LOG_DIR (default /tmp/aaren_gpu_check)
#
# A newer transformers than the machine's can be carried as a wheel in .whl/ (it is installed to /tmp/site).
set -u
LOG=${1:-/tmp/aaren_gpu_check}
mkdir -p "$LOG"
export PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1  # PYTHONSAFEPATH=1: every python3 below runs as `python3 -P`
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used,memory.total --format=csv

if ls .whl/transformers-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/transformers-*.whl
  PYTHONPATH=/tmp/site python3 -c "import transformers" && export PYTHONPATH=/tmp/site \
    || echo "carried transformers does not import here: using the machine's own"
fi
SITE="$LOG/site"
rm -rf "$SITE"
[ -e build ] || made_build=1
python3 -m pip install -q --no-deps --no-build-isolation --no-index --no-compile --target "$SITE" . \
  || { echo "gpu_check: cannot install this checkout (pip and setuptools needed)"; exit 1; }
[ -z "${made_build:-}" ] || rm -rf build  # pip's in-tree build folder, if it was not there before
export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
python3 -c "import torch, triton, transformers, aaren_hf.kernels as k
print('torch', torch.__version__, '| triton', triton.__version__, '| transformers', transformers.__version__,
      '|', torch.cuda.get_device_name(), '| backend for CUDA tensors:', k.select_backend(torch.zeros(1, device='cuda')))"

# Budgeted to end inside one 10-minute call (the timeouts below add up to 540 s after the install), in order of
# what matters most: correctness, then the whole model (prefill and generate, decoding in CUDA graphs, then train
# steps), then the window kernels and the scan.
status=0
# -v: each test's result prints as it ends, so a run the timeout stops still shows which passed
timeout 150 python3 -m pytest -v -p no:cacheprovider -m requires_gpu -rfE tests/test_kernels.py tests/test_model.py \
  tests/test_window_step_kernel.py tests/test_generation.py \
  2>&1 | tee "$LOG/test_gpu.log" | grep -E "PASSED|FAILED|ERROR|passed|failed|Error|assert" | tail -60
[ "${PIPESTATUS[0]}" = 0 ] || status=1

# whole model vs teacher (SmolLM2-135M shape, random weights, bf16): tokens/s, peak memory and ratios in one run;
# prefill and generate first (with a profile of the decode step), train steps in a second process, so that a
# train shape that does not fit cannot cost the other rows
timeout 170 python3 benchmarks/bench_model.py --device cuda --train none --repeats 2 --steps 16 --profile \
  --json "$LOG/bench_model.json" 2>&1 | tee "$LOG/bench_model.log" | grep -v "^\["
# decoding as generate(cache_implementation="static") runs it: teacher (StaticCache) and student (static AarenCache)
# each compiled by inductor into CUDA graphs, batch 1, where eager decoding is bound by launches; the log says
# whether a step recompiled or skipped CUDA graphs, and why
TORCH_LOGS=recompiles,perf_hints timeout 110 python3 benchmarks/bench_model.py --device cuda --models teacher,aaren --prompts none --train none \
  --generate 1x4k --steps 32 --compile-decode inductor --json "$LOG/bench_model_graphs.json" 2>&1 \
  | tee "$LOG/bench_model_graphs.log" | grep -v "^\["
timeout 60 python3 benchmarks/bench_model.py --device cuda --prompts none --generate none --repeats 2 --profile \
  --json "$LOG/bench_model_train.json" 2>&1 | tee "$LOG/bench_model_train.log" | grep -v "^\["

# the window branch: its Triton kernels (attention; the decode step) against the PyTorch paths they replaced, in one run
timeout 20 python3 benchmarks/bench_window.py --min-time 0.1 --json "$LOG/bench_window.json" 2>&1 \
  | tee "$LOG/bench_window.log"
timeout 30 python3 benchmarks/bench_kernels.py --seqlens 2048 16384 65536 --min-time 0.2 --decode-batches 1 64 \
  --json "$LOG/bench_b1.json" 2>&1 | tee "$LOG/bench_b1.log"
echo "gpu_check: tests $([ $status = 0 ] && echo passed || echo FAILED)"
exit $status
