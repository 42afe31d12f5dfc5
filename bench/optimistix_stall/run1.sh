#!/bin/bash
# Issue 62, session 23, device call 1: the optimistix "stall" on the TPU, diagnosed
# (bench/tpu-logs/2026-12-07-s23-stall.log). On the device machine, from the repository
# root: `bash bench/optimistix_stall/run1.sh`, with cp311 wheels of optimistix 0.1.0,
# diffrax 0.7.2, equinox 0.13.8, lineax 0.1.1, jaxtyping, wadler-lindig,
# typing-extensions, pyzmq and msgpack in $WHEELS (default .whl-tpu, carried) and tapd's
# native libraries built and carried. (Session 23 ran it from a copy with tapd at
# 353a498 beside it.) Stock jax.debug.print, then `python -m tapd.debug`: 50 ms a line,
# free lines, unpaced (TAPD_GATHER_LATENCY=0); then hand-written loop shapes (synth.py).
set -o pipefail
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")"
ROOT=$(cd ../.. && pwd)
if [ -z "$NO_INSTALL" ]; then
  PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ${WHEELS:-$ROOT/.whl-tpu}/*.whl || exit 1
  export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
export PYTHONPATH=$ROOT:$ROOT/client:$PYTHONPATH
PY=${PY:-python3}
L=$OUT/2026-12-07-s23-stall.log
date -u | tee $L
$PY -c "import jax, tapd, optimistix, diffrax, equinox; print(jax.__version__, jax.devices(), tapd.__file__, optimistix.__version__, diffrax.__version__, equinox.__version__)" 2>&1 | tee -a $L
echo "== optimistix, stock jax.debug.print" | tee -a $L
MODES=${STOCK_MODES:-stock:0.05,stock:0} REPEATS=${REPEATS:-2} timeout ${T1:-100} $PY optx_lv.py 2>&1 >/dev/null | grep -v "^Step" | tee -a $L
echo "== optimistix, python -m tapd.debug" | tee -a $L
MODES=${TAPD_MODES:-tapd:0.05,tapd:0,tapd:0.05:gather_latency=0} REPEATS=${REPEATS:-3} timeout ${T2:-170} $PY -m tapd.debug optx_lv.py 2>&1 >/dev/null | grep -v "^Step" | tee -a $L
echo "== synthetic shapes, python -m tapd.debug" | tee -a $L
STEPS=40 INNER=${INNER:-2000} SIZE=64 REPORT=1 timeout ${T3:-60} $PY -m tapd.debug synth.py 2>&1 >/dev/null | tee -a $L
echo "== synthetic, 4x longer inner loops" | tee -a $L
SHAPES=while_inner_plain,while_bounded_cond STEPS=40 INNER=$((4*${INNER:-2000})) SIZE=64 REPORT=1 timeout ${T4:-40} $PY -m tapd.debug synth.py 2>&1 >/dev/null | tee -a $L
date -u | tee -a $L
