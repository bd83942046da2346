"""What README.md and docs/ name exists: every `module.name` of the project in backticks (a function, class, method or
setting; a name that no longer exists says so: `name` (historical ...)), and every test they cite
(`test_x.py::test_name`, or `::test_name` after one), read from the sources' syntax trees. And the network swap
that README names (`python -m tests.swap_network`), with a network given as module:callable too."""

import ast
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from tests import swap_network
from tests.conftest import (
    BACKGROUND,
    PINNED,
    TEMPLATE_ONLY,
    call,
    image_folder_of_noise,
    needs,
    scenario,
    snapshot,
    width,
)

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted([ROOT / "README.md", *ROOT.glob("docs/*.md")])
SOURCES = [*ROOT.glob("*.py"), *ROOT.glob("safeguards/*.py"), *ROOT.glob("benchmarks/*.py"), *ROOT.glob("tests/*.py")]
QUOTED = re.compile(r"`([^`\n]+)`( ?\(historical)?")
DOTTED = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+(?:\(\))?")
CITED_TEST = re.compile(r"(test_\w+\.py)?::(test_\w+)")


def names_in(body: list[ast.stmt]) -> dict[str, dict | None]:
    """The names a module or class body defines; a class maps to its own names."""
    found: dict[str, dict | None] = {}
    for node in body:
        if isinstance(node, ast.ClassDef):
            found[node.name] = names_in(node.body)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            found[node.name] = None
        elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            found.update({n.id: None for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)})
        elif isinstance(node, ast.Import | ast.ImportFrom):
            found.update({(alias.asname or alias.name).split(".")[0]: None for alias in node.names})
        elif isinstance(node, ast.If | ast.Try | ast.With):
            found.update(names_in(node.body))
    return found


def project() -> dict[str, dict]:
    """Each module's names by its dotted name ("safeguards.failures"), safeguards' also by their own ("failures",
    as the docs write them)."""
    modules = {}
    for path in SOURCES:
        parts = path.relative_to(ROOT).with_suffix("").parts
        modules[".".join(parts)] = modules[parts[-1] if parts[0] == "safeguards" else ".".join(parts)] = names_in(
            ast.parse(path.read_text()).body
        )
    return modules


def missing(name: str, modules: dict[str, dict], classes: dict[str, dict]) -> bool:
    """Whether `name` (module.function, module.Class.method, Class.method) names nothing of the project. A name
    outside it (torch.compile, os._exit, cfg.EPOCHS) is not this test's."""
    parts = name.removesuffix("()").split(".")
    if parts[-1] == "py":  # a file's name: the text says where it is (or was: crash.py, save it as)
        return False
    held = next((k for k in range(len(parts), 0, -1) if ".".join(parts[:k]) in modules), 0)
    scope, rest = (modules[".".join(parts[:held])], parts[held:]) if held else (classes.get(parts[0]), parts[1:])
    if scope is None:
        return False
    for part in rest:
        if scope is None or part not in scope:
            return True
        scope = scope[part]
    return False


@TEMPLATE_ONLY
def test_the_docs_name_only_what_exists():
    modules = project()
    classes = {name: inner for names in modules.values() for name, inner in names.items() if inner is not None}
    tests = {name for module, names in modules.items() if module.startswith("tests.") for name in names}
    wrong = []
    for doc in DOCS:
        for number, line in enumerate(doc.read_text().splitlines(), 1):
            cited_file = None
            for quoted in QUOTED.finditer(line):
                text, historical = quoted.groups()
                if DOTTED.fullmatch(text) and missing(text, modules, classes) and not historical:
                    wrong.append(f"{doc.name}:{number}: {text}")
                for cited in CITED_TEST.finditer(text):
                    cited_file = cited[1] or cited_file
                    where = modules.get(f"tests.{cited_file.removesuffix('.py')}") if cited_file else None
                    if cited[2] not in (tests if where is None else where):
                        wrong.append(f"{doc.name}:{number}: {cited_file or ''}::{cited[2]}")
    assert wrong == [], "\n".join(wrong)


def test_the_check_finds_a_name_that_is_gone():
    modules = project()
    classes = {"Loader": modules["data"]["Loader"]}
    assert missing("settings.check_resume", modules, classes)
    assert missing("data.Loader.gone", modules, classes) and missing("Loader.gone()", modules, classes)
    found = ["failures.run_rank", "safeguards.failures.outcome", "Loader.prepare", "data.py", "train_distribute.main"]
    assert not any(missing(name, modules, classes) for name in [*found, "torch.compile", "cfg.EPOCHS"])


# ----------------------------------------------------------------------------- README's network swap


@TEMPLATE_ONLY
@pytest.mark.parametrize("name", ["cnn", "tests.test_docs:Classifier"])
def test_the_swap_makes_make_model_return_the_network_named(tmp_path, name):
    """A built-in network, or one's own class (module:callable, called with num_classes, as a torchvision or timm
    constructor is): the copy's make_model, as the swap writes it, builds it for any number of classes."""
    copy = swap_network.swapped_copy(tmp_path, swap_network.network_named(name))
    source = (copy / "train_distribute.py").read_text()
    assert "\nWIDTH:" not in source and (copy / "tests" / "test_resnet.py").exists()  # its tests skip there
    written = re.search(r"\ndef make_model\(.*?\n(?=\n\n)", source, re.S)[0]
    scope = {"nn": nn, "SimpleNamespace": SimpleNamespace}
    exec(written, scope)
    model = scope["make_model"](SimpleNamespace(), 3)
    assert model(__import__("torch").zeros(2, 3, 32, 32)).shape == (2, 3)


class Classifier(nn.Module):
    """One's own network, whose last layer is not called head."""

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1))
        self.classifier = nn.Linear(8, num_classes)

    def forward(self, x):
        return self.classifier(self.features(x).flatten(1))


@pytest.mark.parametrize(
    "name, said",
    [
        ("resnet50x", "no network named resnet50x; choose one of cnn, resnet18, mobilenet_v3_small, or give "
         "module:callable"),
        ("no_such_module:Net", "cannot import no_such_module:Net (No module named 'no_such_module'); put its module "
         f"on PYTHONPATH or in {ROOT}"),
    ],
)  # fmt: skip
def test_a_network_the_swap_cannot_find_is_one_line_before_anything_is_copied(name, said):
    result = subprocess.run(
        [sys.executable, "-m", "tests.swap_network", name], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 2 and result.stdout == "" and result.stderr == f"error: {said}\n"


@TEMPLATE_ONLY
def test_the_readmes_sample_first_line_is_what_its_command_builds_now():
    """README's sample output: its first line (the network, its parameter count, the data, the steps) is what the
    command above it builds with this version; only the words on precision may name another CPU kind's."""
    import torch

    import data
    import train_distribute
    from distribute_tools import DistInfo
    from safeguards import files, settings

    command, first = re.search(r"\$ python train_distribute.py (.*)\n(.*)\n", (ROOT / "README.md").read_text()).groups()
    cfg = settings.read(train_distribute, [*PINNED, *command.split()])  # the block as shipped, then the command
    info = DistInfo(0, 0, 2, 2, torch.device("cpu"), "gloo")  # the sample's 2 ranks on a CPU
    train, _, record = data.load(cfg, info, torch.channels_last)
    model = train_distribute.make_model(cfg, len(record["classes"]))
    line = files.describe(model, cfg, info, record, train.steps_per_epoch(cfg.BATCH_SIZE), "the precision")
    assert first.rsplit(" | ", 1)[0] == line.rsplit(" | ", 1)[0]


# ----------------------------------------------------------------------------- README's recipes for other layouts


def readme_recipes() -> tuple[str, str, str]:
    """README's code for data in another layout, as written there: list_folder for a CSV; for an .npz, the settings
    block's DATASET line and the branch for data.load."""
    section = (ROOT / "README.md").read_text().split("**Data in another layout.**")[1]
    csv_recipe, npz_recipe = re.findall(r"```python\n(.*?)```", section, re.S)[:2]
    setting, branch = npz_recipe.split("\n", 1)
    return csv_recipe, setting, branch


def train_with_recipe(layout: str, *argv: str) -> int:
    """`python train_distribute.py *argv` after README's edit for `layout` ("csv" or "npz"), made as a user makes it
    (data.py's text with the recipe in its place), in this process only: the server's fork, whose ranks are forked from
    it and have the edit too, while the repository stays as it is."""
    import data
    import train_distribute

    csv_recipe, setting, branch = readme_recipes()
    text = Path(data.__file__).read_text()
    if layout == "csv":
        start = text.index("\ndef list_folder(")
        edited = text[:start] + "\n" + csv_recipe + text[text.index("\n\n\n", start) :]  # the function replaced
    else:
        exec(setting.split("  # ")[0], train_distribute.__dict__)  # DATASET's choices and value, as the block's line
        edited = text.replace("\n    else:\n", f"\n{branch}    else:\n", 1)  # data.load's branch before its else
    assert edited != text
    exec(compile(edited, data.__file__, "exec"), data.__dict__)
    return train_distribute.main(list(argv), entrypoint=train_distribute.main)


def recipe_runs() -> tuple[Path, dict, list, subprocess.CompletedProcess, bool]:
    """Each recipe as README writes it, in the background as the session starts (conftest.needs): a CSV of image paths
    and class names, and an .npz of arrays, each trained for an epoch; then a resume on other arrays of the shapes."""
    folder = Path(tempfile.mkdtemp(prefix="recipes-"))
    images, arrays = folder / "images", folder / "arrays"
    image_folder_of_noise(images, train=96, test=24, size=16)
    for split in ("train", "test"):
        paths = sorted((images / split).rglob("*.png"))
        rows = [f"{path.relative_to(images)},{'cat' if path.parent.name == 'a' else 'dog'}" for path in paths]
        (images / f"{split}.csv").write_text("path,label\n" + "\n".join(rows) + "\n")
    rng = np.random.default_rng(0)
    npz = {f"x_{s}": rng.integers(0, 256, (n, 16, 16, 3), dtype=np.uint8) for s, n in (("train", 96), ("test", 24))}
    npz |= {f"y_{s}": rng.integers(0, 3, n) for s, n in (("train", 96), ("test", 24))}
    arrays.mkdir()
    np.savez(arrays / "data.npz", **npz)
    small, done = [*PINNED, *width(8), "--batch_size=48", "--world_size=2", "--epochs=1", "--image_size=16"], []
    for layout, data_dir, dataset in (("csv", images, "imagefolder"), ("npz", arrays, "npz")):
        argv = [*small, f"--dataset={dataset}", f"--data_dir={data_dir}", f"--output_dir={data_dir}/out"]
        done.append(call("tests.test_docs:train_with_recipe", layout, *argv, nice=BACKGROUND))
    before = snapshot(arrays / "out")
    np.savez(arrays / "data.npz", **{**npz, "x_train": 255 - npz["x_train"]})  # other images, the same shapes
    argv = [f"--output_dir={arrays}/out", "--resume", "--epochs=2"]
    refused = call("tests.test_docs:train_with_recipe", "npz", *argv, nice=BACKGROUND)
    return folder, npz, done, refused, snapshot(arrays / "out") == before


@needs((recipe_runs,))
def test_readmes_recipes_train_on_a_csv_of_paths_and_on_an_npz_refuse_other_data_on_resume_and_classify():
    """Both recipes train; the classifier takes the CSV's paths and the arrays' uint8 images; a resume on other arrays
    is refused in one line, the run's folder left as it was."""
    from predict import Classifier

    folder, npz, done, refused, unchanged = scenario(recipe_runs)
    for result, dataset in zip(done, ("imagefolder", "npz"), strict=True):
        assert result.returncode == 0, result.stdout + result.stderr
        assert f"96 train, 24 test images on {dataset} |" in result.stdout.splitlines()[0], result.stdout
    images, arrays = folder / "images", folder / "arrays"
    classifier = Classifier(str(images / "out" / "checkpoint.pt"))
    paths = [str(images / line.split(",")[0]) for line in (images / "test.csv").read_text().splitlines()[1:]]
    assert classifier.classes == ["cat", "dog"] and classifier(paths).shape == (24, 2)
    classifier = Classifier(str(arrays / "out" / "checkpoint.pt"))
    assert classifier.classes == ["0", "1", "2"]
    assert torch.allclose(classifier.probabilities(torch.from_numpy(npz["x_test"])).sum(dim=1), torch.ones(24))
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1 and unchanged, refused.stderr
    assert f"error: the checkpoint in {arrays}/out was trained on other data (96 train" in refused.stderr


# ----------------------------------------------------------------------------- the DDP: comments
MEETING = re.compile(  # calls where every rank must take part: collectives, and the functions that make them
    r"\bdist\.(all_reduce|broadcast|barrier|all_gather_object|broadcast_object_list|init_process_group)\("
    r"|\b(all_ranks_try|all_ranks_begin|readable_enough|attempt_store|DistributedDataParallel|evaluate)\("
    r"|\b(refuse_shared_gpu|store\.wait)\("
    r"|\b(start\.restore|data\.load|distribute_tools\.setup|distribute_tools\.cleanup)\("
    r"|\.backward\(|\.step\(|\b(train|eval)_batches\("  # DDP's all-reduce, Muon's, a streamed pass's end
)


def test_ddp_comments_mark_every_call_where_ranks_meet_and_only_those():
    """README: every place where ranks meet has a comment starting `DDP:` in the files a reader adapts, and a reader
    can trust it: each call where every rank must take part has one on its line or above it, and each such comment
    is on, or just above, such a call."""
    for name in ("train_distribute.py", "distribute_tools.py", "data.py", "muon.py"):
        lines = (ROOT / name).read_text().splitlines()
        code = [line.split("  #")[0] if not line.lstrip().startswith(("#", '"')) else "" for line in lines]
        for n, line in enumerate(code):
            if MEETING.search(line) and not line.lstrip().startswith("def "):
                assert any("DDP:" in above for above in lines[max(0, n - 4) : n + 1]), f"{name}:{n + 1}: {line}"
        for n, line in enumerate(lines):
            if (
                "DDP:" in line and not line.startswith(('"', " " * 4 + '"')) and n > 12
            ):  # (the docstring says what it is)
                assert any(MEETING.search(statement) for statement in code[n : n + 5]), f"{name}:{n + 1}: {line}"


def test_the_swap_prints_its_own_usage_on_help(capsys):
    """`python -m tests.swap_network --help`: its usage, not pytest's from a swapped copy."""
    assert swap_network.main(["--help"]) == 0
    assert "python -m tests.swap_network mobilenet_v3_small" in capsys.readouterr().out
