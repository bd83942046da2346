"""benchmarks/launches.py: the operations (GPU kernel launches, counted on the CPU) of a training step, by phase, for
this project and for the seed's step."""

import json
from pathlib import Path

import pytest

from benchmarks import launches
from tests.conftest import SETTINGS, call

# Non-view operations per step of a whole epoch at width 8, default settings, one rank: 242.8 on torch 2.14.1 (the
# seed's step: 368). A change that adds launches to every step fails here first.
BUDGET = 280
MADE_PER_STEP = ("aten::zeros", "aten::zeros_like", "aten::empty.memory_format", "aten::empty_like", "aten::new_zeros")


def count(out_dir: str) -> int:
    """What the test runs (tests.conftest.call), in a process of its own: it joins and leaves a one-rank group."""
    seed, project, _, counter = launches.measure(launches.parse_args(["--width=8", "--batch_size=16", "--steps=2"]))
    made = {f"{phase} {op}": n for (phase, op), n in counter.ops.items() if op in MADE_PER_STEP}
    Path(out_dir, "counts.json").write_text(json.dumps({"seed": vars(seed), "project": vars(project), "made": made}))
    return 0


@pytest.mark.skipif("WIDTH" not in SETTINGS, reason="the budget is the template ResNet's; another network swapped in")
def test_a_training_step_issues_fewer_operations_than_the_seeds_and_muon_makes_no_tensor_per_step(tmp_path):
    result = call("tests.test_launches:count", str(tmp_path))
    assert result.returncode == 0, result.stderr
    counts = json.loads((tmp_path / "counts.json").read_text())
    seed, project = counts["seed"], counts["project"]
    assert project["total"] <= min(seed["total"], BUDGET), (project, seed)
    assert all(project[phase] > 0 for phase in ("batch", "forward", "backward", "optimizer", "metrics")), project
    assert not [op for op in counts["made"] if op.startswith("optimizer")], counts["made"]  # state made once
