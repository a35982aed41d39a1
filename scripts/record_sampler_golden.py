"""Record the sampler runs of tests/sampling/golden_cases.py with the sampler of commit REV, for
tests/sampling/test_sampler_golden.py: `python scripts/record_sampler_golden.py REV [--no-smollm2]`.

REV is checked out in a temporary git worktree and its jgrpo samples the cases in a fresh process at the test
suite's XLA flags and matmul precision (tests/conftest.py), so the recorded numbers are what the suite would
have computed then. Written to tests/testdata/sampler_golden.npz. Recorded once, from the commit before the paged
KV cache (the ring cache it replaced): the same tokens, log-probs within 1e-5, is what the paged cache must give.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from compare_with_commit import CPU_ISA_FLAG, worktree  # noqa: E402

OUT = ROOT / "tests" / "testdata" / "sampler_golden.npz"
CHILD = """
import importlib.util, sys
import jax, numpy as np
jax.config.update("jax_default_matmul_precision", "highest")
spec = importlib.util.spec_from_file_location("golden_cases", {cases!r})
cases = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cases)
from tests.helpers_models import sampler_model
import tempfile, pathlib
with tempfile.TemporaryDirectory() as tmp:
    _, (graphdef, params, _) = sampler_model("llama", pathlib.Path(tmp))
    np.savez({out!r}, **cases.record_all((graphdef, params), {smollm2}))
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("rev")
    parser.add_argument("--no-smollm2", action="store_true")
    args = parser.parse_args()
    # The suite's flags (tests/conftest.py), its CPU instruction set included: recorded as the tests replay.
    flags = f"--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0 {CPU_ISA_FLAG}".strip()
    with worktree(args.rev) as theirs:
        code = CHILD.format(cases=str(ROOT / "tests" / "sampling" / "golden_cases.py"), out=str(OUT),
                            smollm2=not args.no_smollm2)
        env = {**os.environ, "PYTHONPATH": str(theirs), "JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags}
        proc = subprocess.run([sys.executable, "-c", code], cwd=theirs, env=env, capture_output=True, text=True)
        if proc.returncode:
            print(proc.stderr[-4000:], file=sys.stderr)
            return 1
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
