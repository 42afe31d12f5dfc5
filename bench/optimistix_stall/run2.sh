#!/bin/bash
# Issue 62, session 23, device call 2 (bench/tpu-logs/2026-12-07-s23-stall-held.log,
# -s23-stall-slow.log): tests/tpu/test_tpu_held_host.py, then optimistix under
# `python -m tapd.debug` with a printer slower than its step (0.2 s a line against ~87 ms
# a step), and free. Set up as run1.sh says.
set -o pipefail
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/../.."
ROOT=$PWD
if [ -z "$NO_INSTALL" ]; then
  PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ${WHEELS:-$ROOT/.whl-tpu}/*.whl || exit 1
  export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
export PYTHONPATH=$ROOT:$ROOT/client:$PYTHONPATH
PY=${PY:-python3}
L=$OUT/2026-12-07-s23-stall-held.log
date -u | tee $L
echo "== pytest tests/tpu/test_tpu_held_host.py" | tee -a $L
timeout ${T1:-120} $PY -m pytest -c /dev/null --rootdir . -p no:cacheprovider -q -s ${TESTS:-tests/tpu/test_tpu_held_host.py} 2>&1 | tee -a $L
L2=$OUT/2026-12-07-s23-stall-slow.log
date -u | tee $L2
echo "== optimistix under python -m tapd.debug, 0.2 s a printed line, then free" | tee -a $L2
(cd bench/optimistix_stall && MODES=${MODES:-tapd:0.2,tapd:0} REPEATS=${REPEATS:-3} timeout ${T2:-110} $PY -m tapd.debug optx_lv.py 2>&1 >/dev/null | grep -v "^Step" | tee -a $L2)
date -u | tee -a $L2
