"""README's network swap, done in a copy of the project, then the whole suite run there.

    python -m tests.swap_network                        # a small CNN in place of the ResNet
    python -m tests.swap_network mobilenet_v3_small     # or torchvision's resnet18 or mobilenet_v3_small
    python -m tests.swap_network resnet18 -m "not slurm" -x   # the suite's own options may follow

The copy gets exactly the edit README names: `make_model` returns the other network, WIDTH is deleted
from the settings block, and tests/test_resnet.py (the ResNet's own tests) is deleted. Nothing else
changes, so every failure there is a promise of "swap the network in one place" that does not hold. The copy is
of the project's folder as it is (a git checkout or not), without hidden folders, caches, data or results.
"""

import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SMALL_CNN = """nn.Sequential(
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
    )"""
NETWORKS = {  # what make_model returns in the copy
    "cnn": SMALL_CNN,
    "resnet18": "torchvision.models.resnet18(num_classes=num_classes)",
    "mobilenet_v3_small": "torchvision.models.mobilenet_v3_small(num_classes=num_classes)",
}
NOT_COPIED = shutil.ignore_patterns(".*", "__pycache__", "data", "output", "*.egg-info")


def make_model_returning(network: str) -> str:
    imports = "    import torchvision\n\n" if "torchvision" in network else ""
    return (
        "def make_model(cfg: SimpleNamespace, num_classes: int) -> nn.Module:\n"
        '    """Another network in place of the ResNet."""\n'
        f"{imports}    return {network}\n"
    )


def swapped_copy(folder: Path, network: str) -> Path:
    """The project in `folder`, with make_model returning `network`."""
    shutil.copytree(ROOT, folder, ignore=NOT_COPIED, dirs_exist_ok=True)
    script = folder / "train_distribute.py"
    source = script.read_text()
    source, models = re.subn(
        r"def make_model\(.*?\n(?=\n\n)", lambda _: make_model_returning(network), source, count=1, flags=re.S
    )
    source, settings = re.subn(r"^WIDTH: .*\n", "", source, flags=re.M)
    source = source.replace("from resnet import ResNet\n", "")
    if (models, settings) != (1, 1):
        sys.exit(f"could not make the swap in {script}: make_model or WIDTH not found")
    script.write_text(source)
    (folder / "tests" / "test_resnet.py").unlink()
    return folder


def main(args: list[str]) -> int:
    name = args.pop(0) if args and not args[0].startswith("-") else "cnn"
    if name not in NETWORKS:
        sys.exit(f"error: no network named {name}; choose one of {', '.join(NETWORKS)}")
    with tempfile.TemporaryDirectory(prefix=f"swapped-{name}-") as folder:
        copy = swapped_copy(Path(folder), NETWORKS[name])
        print(f"make_model returns {name} in {copy}; running the suite there", flush=True)
        return subprocess.run([sys.executable, "-m", "pytest", "-q", *args], cwd=copy).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
