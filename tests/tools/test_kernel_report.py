"""`python -m tools.kernel_report --tensor-parallel-size N [--expert-parallel]`: the forward it
drives is rank 0's, so the MoE kernels it reports run a rank's shapes: every expert at 1/N of
its width under TP, its experts whole and one pair a row under EP."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.flagship import MINI_FLAGSHIP
from tools.kernel_report import ROOT

# Drives the forward at TP 2, then at TP 2 with EP, in one process (the compiler's mode is
# the process's); prints each variant of the routed MoE's first GEMM, and its decode launches'
# pairs and experts' width.
DRIVE = """
import sys
from pathlib import Path
from tools.compiling import catching, compiler_mode
from tools.kernel_report import drive
compiler_mode()
for placed in (False, True):
    with catching() as c:
        drive(Path(sys.argv[1]), (1,), c, (2, placed))
    for v in c.variants.values():
        if v.kernel == "_gate_up_kernel":
            print(placed, "variant", v.label)
    for launch in c.launches:
        if launch.kernel == "_gate_up_kernel" and launch.phase == "decode":
            print(placed, "decode", launch.sizes["num_pairs"], launch.sizes["inner"])
"""


def test_the_moe_kernels_run_a_ranks_shapes(tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text(MINI_FLAGSHIP.to_json())
    done = subprocess.run(
        [sys.executable, "-c", DRIVE, str(config)], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    seen: dict[tuple[str, str], set[str]] = {}
    for line in done.stdout.splitlines():
        placed, kind, rest = line.split(" ", 2)
        seen.setdefault((placed, kind), set()).add(rest)
    k, inner = MINI_FLAGSHIP.num_experts_per_tok, MINI_FLAGSHIP.moe_intermediate_size
    rows = 4  # a decode of one sequence, padded to the row tile
    assert seen["False", "decode"] == {f"{rows * k} {inner // 2}"}
    assert all(f"TOP_K={k}," in v for v in seen["False", "variant"])
    assert seen["True", "decode"] == {f"{rows * k // 2} {inner}"}
    assert all("TOP_K=1," in v for v in seen["True", "variant"])
