"""README's network swap, done in a copy of the project, then the whole suite run there.

    python -m tests.swap_network                        # a small CNN in place of the ResNet
    python -m tests.swap_network mobilenet_v3_small     # or torchvision's resnet18 or mobilenet_v3_small
    python -m tests.swap_network resnet18 -m "not slurm" -x   # the suite's own options may follow
    python -m tests.swap_network timm.models:resnet18   # any module:callable, called as callable(num_classes=N):
    PYTHONPATH=~/nets python -m tests.swap_network mynet:Net   # your own class, on PYTHONPATH or in the project

The copy gets exactly the edit README names: `make_model` returns the other network and WIDTH is deleted from the
settings block (the ResNet's own tests, tests/test_resnet.py, then skip). Nothing else changes, so every failure
there is a promise of "swap the network in one place" that does not hold. The copy is
of the project's folder as it is (a git checkout or not), without hidden folders, caches, data or results.
"""

import importlib
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
NETWORKS = {  # what make_model returns in the copy: its code, or module:callable, called as callable(num_classes=N)
    "cnn": SMALL_CNN,
    "resnet18": "torchvision.models:resnet18",
    "mobilenet_v3_small": "torchvision.models:mobilenet_v3_small",
}
CALLABLE = re.compile(r"([A-Za-z_][\w.]*):([A-Za-z_]\w*)")
NOT_COPIED = shutil.ignore_patterns(".*", "__pycache__", "data", "output", "*.egg-info")


def make_model_returning(network: str) -> str:
    if found := CALLABLE.fullmatch(network):
        module, name = found.groups()
        body = f"    from {module} import {name}\n\n    return {name}(num_classes=num_classes)\n"
    else:
        body = f"    return {network}\n"
    return (
        "def make_model(cfg: SimpleNamespace, num_classes: int) -> nn.Module:\n"
        '    """Another network in place of the ResNet."""\n' + body
    )


def network_named(name: str) -> str:
    """The built-in network of this name, or module:callable where that callable can be imported here."""
    if name in NETWORKS:
        return NETWORKS[name]
    if not (found := CALLABLE.fullmatch(name)):
        refuse(f"no network named {name}; choose one of {', '.join(NETWORKS)}, or give module:callable")
    try:
        getattr(importlib.import_module(found[1]), found[2])
    except (ImportError, AttributeError) as e:
        refuse(f"cannot import {name} ({e}); put its module on PYTHONPATH or in {ROOT}")
    return name


def refuse(problem: str) -> None:
    print(f"error: {problem}", file=sys.stderr)
    sys.exit(2)


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
        refuse(f"could not make the swap in {script}: make_model or WIDTH not found")
    script.write_text(source)
    return folder


def main(args: list[str]) -> int:
    if args[:1] in (["-h"], ["--help"]):  # its own usage; pytest's options after a network: `cnn --help`
        print(__doc__.split("\n\n")[1])
        return 0
    name = args.pop(0) if args and not args[0].startswith("-") else "cnn"
    network = network_named(name)
    with tempfile.TemporaryDirectory(prefix=f"swapped-{name.replace(':', '-')}-") as folder:
        copy = swapped_copy(Path(folder), network)
        print(f"make_model returns {name} in {copy}; running the suite there", flush=True)
        return subprocess.run([sys.executable, "-m", "pytest", "-q", *args], cwd=copy).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
