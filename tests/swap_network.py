"""README's network swap, done in a copy of the project, then the whole suite run there.

    python -m tests.swap_network              # the suite's own options may follow, e.g. -m "not slurm" -x

The copy gets exactly the edit README names: `make_model` returns a small CNN, WIDTH and RELU_AFTER_SUM are
deleted from the settings block, and tests/test_resnet.py (the ResNet's own tests) is deleted. Nothing else
changes, so every failure there is a promise of "swap the network in one place" that does not hold.
"""

import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SMALL_CNN = '''def make_model(cfg: SimpleNamespace, num_classes: int) -> nn.Module:
    """A small CNN in place of the ResNet."""
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1, bias=False),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1, bias=False),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, num_classes),
    )
'''


def swapped_copy(folder: Path) -> Path:
    """The project's tracked files in `folder`, with the network swapped."""
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    for name in files:
        if (ROOT / name).is_file():
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, folder / name)
    script = folder / "train_distribute.py"
    source = script.read_text()
    source, models = re.subn(r"def make_model\(.*?\n(?=\n\n)", SMALL_CNN, source, count=1, flags=re.S)
    source, settings = re.subn(r"^(WIDTH|RELU_AFTER_SUM): .*\n", "", source, flags=re.M)
    source = source.replace("from resnet import ResNet\n", "")
    if (models, settings) != (1, 2):
        sys.exit(f"could not make the swap in {script}: make_model or WIDTH / RELU_AFTER_SUM not found")
    script.write_text(source)
    (folder / "tests" / "test_resnet.py").unlink()
    return folder


def main(pytest_args: list[str]) -> int:
    with tempfile.TemporaryDirectory(prefix="swapped-") as folder:
        copy = swapped_copy(Path(folder))
        print(f"the network swapped in {copy}; running the suite there", flush=True)
        return subprocess.run([sys.executable, "-m", "pytest", "-q", *pytest_args], cwd=copy).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
