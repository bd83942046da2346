"""benchmarks/launches.py: the operations (GPU kernel launches, counted on the CPU) of a training step, by phase, for
this project and for the seed's step."""

import json
from pathlib import Path

import pytest

from benchmarks import launches
from tests.conftest import SETTINGS, TEMPLATE_ONLY, call

# Non-view operations per step of a whole epoch at width 8, default settings, one rank: 258.8 on torch 2.14.1 (the
# seed's step: 368). A change that adds launches to every step fails here first.
BUDGET = 280
MADE_PER_STEP = ("aten::zeros", "aten::zeros_like", "aten::empty.memory_format", "aten::empty_like", "aten::new_zeros")


def count(out_dir: str, accumulate: str) -> int:
    """What the test runs (tests.conftest.call), in a process of its own: it joins and leaves a one-rank group."""
    options = ["--width=8", "--batch_size=16", "--steps=2", f"--accumulate={accumulate}"]
    seed, project, _, counter = launches.measure(launches.parse_args(options))
    made = {f"{phase} {op}": n for (phase, op), n in counter.ops.items() if op in MADE_PER_STEP}
    counts = {
        "seed": vars(seed),
        "project": vars(project),
        "made": made,
        "casts": counter.ops["forward", "aten::_to_copy"],
    }
    Path(out_dir, f"counts{accumulate}.json").write_text(json.dumps(counts))
    return 0


@TEMPLATE_ONLY  # the budget is the template ResNet's
@pytest.mark.skipif("WIDTH" not in SETTINGS, reason="the budget is the template ResNet's; another network swapped in")
def test_a_training_step_issues_fewer_operations_than_the_seeds_and_muon_makes_no_tensor_per_step(tmp_path):
    for accumulate in ("1", "2"):
        result = call("tests.test_launches:count", str(tmp_path), accumulate)
        assert result.returncode == 0, result.stderr
    one, two = (json.loads((tmp_path / f"counts{a}.json").read_text()) for a in ("1", "2"))
    seed, project = one["seed"], one["project"]
    assert project["total"] <= min(seed["total"], BUDGET), (project, seed)
    assert all(project[phase] > 0 for phase in ("batch", "forward", "backward", "optimizer", "metrics")), project
    assert not [op for op in one["made"] if op.startswith("optimizer")], one["made"]  # state made once
    # two micro-batches a step, the seed's step split alike: fewer operations, and the weights cast to bf16 once
    assert two["project"]["total"] <= two["seed"]["total"], two
    assert two["casts"] - one["casts"] < one["casts"] / 2, (one["casts"], two["casts"])
