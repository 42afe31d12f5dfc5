"""Check tests/test_host_callback_compat.py's expectations against the real host_callback.

Runs every case of tests/apps/hcb_cases.py in closure mode with
`jax.experimental.host_callback` itself (jax 0.4.30, legacy mode, outfeed receiver),
then applies the test's checks to what it printed. Not part of the suite: it needs an
old JAX in a separate environment.

    python3.11 -m venv /tmp/jax0430
    /tmp/jax0430/bin/pip install jax==0.4.30 jaxlib==0.4.30 'numpy<2' scipy
    .venv/bin/python tests/apps/hcb_validate.py /tmp/jax0430/bin/python

Every case passes but the checkpoint ones (tapd taps a checkpointed region once,
host_callback twice: REMAT_TAPS_TWICE in the test). With JAX_HOST_CALLBACK_OUTFEED=False
(host_callback's custom-call mode) the exception cases and device_index=1 fail too, as
host_callback's own tests skipped them there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

TESTS = Path(__file__).parent.parent
sys.path.insert(0, str(TESTS))

import test_host_callback_compat as compat  # noqa: E402


def main() -> int:
    python = sys.argv[1]
    failures = 0
    with tempfile.TemporaryDirectory() as directory:
        for group, cases in compat.GROUPS.items():
            path = Path(directory) / f"{group}.jsonl"
            env = {**os.environ, "HCB_IMPL": "jax", "HCB_MODE": "closure",
                   "HCB_RESULTS": str(path), "JAX_PLATFORMS": "cpu",
                   "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
                   "JAX_HOST_CALLBACK_OUTFEED": os.environ.get("JAX_HOST_CALLBACK_OUTFEED",
                                                               "True")}  # fmt: skip
            subprocess.run([python, str(TESTS / "apps" / "hcb_cases.py"), *cases], env=env,
                           timeout=600, check=False)  # fmt: skip
            results = {}
            if path.exists():
                results = {r["case"]: r for r in map(json.loads, path.read_text().splitlines())}
            for case in cases:
                raw = results.get(case, {"status": "error", "error": "no result"})
                result = compat.CaseResult(
                    case, "closure", raw["status"], raw.get("values", {}),
                    raw.get("output", ""), raw.get("error", ""), raw.get("traceback", ""),
                    raw.get("devices", ["cpu:0", "cpu:1"]),
                )  # fmt: skip
                try:
                    compat.CHECKS[case](result)
                    print(f"PASS {case}")
                except pytest.skip.Exception as exc:
                    print(f"SKIP {case}: {exc}")
                except BaseException as exc:
                    failures += 1
                    print(f"FAIL {case}: {type(exc).__name__} {exc}\n  output: {result.output!r}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
