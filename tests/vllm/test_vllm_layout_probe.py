"""The CPU layout the connector converts to is the one vLLM's CPU backend really writes."""

from __future__ import annotations

import json
import subprocess

from tests.support.processes import ROOT
from tests.vllm.conftest import vllm_python


def test_cpu_layout_reads_what_vllm_writes():
    result = subprocess.run(
        [str(vllm_python()), "-m", "tests.vllm.layout_probe"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    probed = json.loads(result.stdout.strip().splitlines()[-1])
    assert set(probed) == {"float32", "float16", "bfloat16"}
    # float32 always runs the "vec" kernels; bfloat16 runs AMX's on CPUs that have it, whose
    # pages the connector refuses to convert (kvsp_vllm.connector._check_cpu_isa).
    assert probed["float32"]["isa"] == "vec"
    for dtype, found in probed.items():
        if found["isa"] == "vec":
            assert found["k"] and found["v"], dtype
