"""predict.py: a run's checkpoint classifies image files as the run's evaluation did, as CSV on stdout; bad input is
one line with exit 2."""

import csv
import io
import itertools
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
from PIL import Image

import data
import train_distribute
from tests.conftest import HANG_TIMEOUT, TEMPLATE_ONLY, TINY, image_folder_of_noise, launch, read_config, run_script

CLASSES = {"a": "chat noir", "b": "élan"}  # class names with a space and a non-ASCII letter


def predict(*args: object) -> subprocess.CompletedProcess:
    """`python predict.py *args`, forked from the test server."""
    run = launch(*map(str, args), module="predict")
    out, err = run.communicate(timeout=HANG_TIMEOUT)
    return subprocess.CompletedProcess(args, run.returncode, out, err)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, reference_run) -> tuple[Path, Path]:
    """A run on an image folder of 20x20 images stretched to 16x16 (TTA on, as by default), its classes hard enough
    to tell apart that the ResNet gets some test images wrong: its output folder and its test folder. It fine-tunes
    the reference run's network (10 classes; here 2) from its state_dict alone, saved with DDP's prefixes: every
    tensor but the classifier's last layer comes from there.
    Its test folder also holds what training's listing counts under a class (an image in a nested folder) or leaves
    out (a hidden folder's image, a macOS ._ file, an image beside the class folders)."""
    tmp = tmp_path_factory.mktemp("predict")
    image_folder_of_noise(tmp / "images", train=300, test=60, size=20, brighter=25)
    for split in ("train", "test"):
        for old, new in CLASSES.items():
            (tmp / "images" / split / old).rename(tmp / "images" / split / new)
    test = tmp / "images" / "test"
    for folder in ("nested", ".ipynb_checkpoints"):
        (test / "élan" / folder).mkdir()
    (test / "élan" / "0001.png").rename(test / "élan" / "nested" / "0001.png")
    shutil.copy(test / "élan" / "0003.png", test / "élan" / ".ipynb_checkpoints" / "0003.png")
    (test / "chat noir" / "._0000.png").write_bytes(b"\x00\x05\x16\x07")
    shutil.copy(test / "chat noir" / "0000.png", test / "beside.png")
    settings = ["--dataset=imagefolder", f"--data_dir={tmp / 'images'}", "--image_size=16", "--epochs=6"]
    init_from = tmp / "downloaded weights.pth"  # a bare state_dict, as torchvision publishes, saved from DDP here
    weights = torch.load(reference_run[0] / "checkpoint.pt", weights_only=True)["model"]
    torch.save({f"module.{name}": tensor for name, tensor in weights.items()}, init_from)
    result = run_script(*TINY, *settings, "--num_workers=0", f"--init_from={init_from}", f"--output_dir={tmp / 'out'}")
    assert result.returncode == 0, result.stderr
    fine_tuning, first, *_ = lines(result.stdout)
    assert "images on imagefolder (20x20 stretched to 16x16) |" in first, first
    model = train_distribute.make_model(read_config([*TINY, *settings]), len(CLASSES))
    shapes = [(name, p.shape[0], p.numel()) for name, p in model.named_parameters()]
    head = list(itertools.takewhile(lambda shape: shape[1] == len(CLASSES), reversed(shapes)))  # the last layer
    total = sum(numel for *_, numel in shapes)
    assert fine_tuning == (
        f"fine-tuning from {init_from}: {total - sum(numel for *_, numel in head):,} of {total:,} parameters loaded; "
        f"left as built: {', '.join(name for name, *_ in reversed(head))}"
    )
    assert pd.read_csv(tmp / "out" / "pytorch_res.csv")["epoch"].tolist() == [1, 2, 3, 4, 5, 6]  # epochs start anew
    return tmp / "out", test


def lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def rows(stdout: str) -> list[dict]:
    return list(csv.DictReader(io.StringIO(stdout)))


def test_predict_on_the_runs_own_test_folder_gives_its_final_accuracy_and_each_classes(trained):
    """Over exactly the images the run evaluated (training's listing: the nested one counted under its class, the
    hidden ones skipped without a word, the one beside the class folders classified but not counted), in the run's
    precision: the run's accuracy; each image's true class beside the predicted one, and a line per class."""
    out, test = trained
    result = predict(out / "checkpoint.pt", test)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("path,class,probability,true_class\n")
    found = rows(result.stdout)
    truth = {row["path"]: Path(row["path"]).relative_to(test).parts[0] for row in found}
    assert all(
        row["true_class"] == (truth[row["path"]] if truth[row["path"]] in CLASSES.values() else "") for row in found
    )
    per_class = [
        f"class {name}: accuracy {sum(r['class'] == name for r in of) / len(of):.4f} on {len(of)} images"
        for name in sorted(CLASSES.values())
        for of in [[row for row in found if row["true_class"] == name]]
    ]
    evaluated = [path for path, _ in data.list_folder(str(test.parent), "test")[1]]
    assert (
        len(evaluated) == 60
        and ", 60 test images of " in torch.load(out / "checkpoint.pt", weights_only=True)["data"]["identity"]
    )
    assert [row["path"] for row in found] == sorted([*evaluated, str(test / "beside.png")])
    assert all(0.5 <= float(row["probability"]) <= 1 for row in found)  # the likeliest of two classes
    right = sum(Path(row["path"]).relative_to(test).parts[0] == row["class"] for row in found)
    assert lines(result.stderr) == [f"accuracy {right / 60:.4f} on 60 images", *per_class]
    final = pd.read_csv(out / "pytorch_res.csv")["acc"].iloc[-1]
    assert right == round(final * 60), (right, final)


@pytest.fixture(scope="module", params=["auto", "fp16"])
def near_tie_run(trained, tmp_path_factory, request) -> tuple[str, Path, subprocess.CompletedProcess]:
    """A test folder of near ties: blends of the two classes' images around where the trained network's fp32 class
    changes, evaluated by a run that starts from it (an epoch at a negligible LR: the same weights, BatchNorm's
    statistics drawn again) in this PRECISION; its checkpoint, the folder and predict.py's answer on it."""
    from predict import Classifier

    out, test = trained
    tmp = tmp_path_factory.mktemp("near-ties")
    images = tmp / "images"
    images.mkdir()
    (images / "train").symlink_to(test.parent / "train")
    near_ties(Classifier(str(out / "checkpoint.pt"), device="cpu"), test, images / "test")
    run = [*TINY, "--dataset=imagefolder", f"--data_dir={images}", "--image_size=16", "--epochs=1", "--num_workers=0"]
    run += ["--lr=1e-12", "--augment=False", f"--init_from={out / 'checkpoint.pt'}", f"--output_dir={tmp / 'out'}"]
    assert run_script(*run, f"--precision={request.param}").returncode == 0
    checkpoint = str(tmp / "out" / "checkpoint.pt")
    return checkpoint, images, predict(checkpoint, images / "test")


def test_predict_gives_the_runs_classes_and_accuracy_on_near_ties(near_tie_run):
    """predict.py's accuracy is the run's, its classes those of the run's precision, on images where a rounding
    difference would change a class."""
    from predict import Classifier

    checkpoint, _, found = near_tie_run
    acc = pd.read_csv(Path(checkpoint).parent / "pytorch_res.csv")["acc"]
    count = len(rows(found.stdout))
    assert lines(found.stderr)[0] == f"accuracy {acc.iloc[-1]:.4f} on {count} images", (found.stderr, acc)
    classifier = Classifier(checkpoint, device="cpu")
    paths = [row["path"] for row in rows(found.stdout)]
    assert [classifier.classes[i] for i in classifier(paths).argmax(1)] == [row["class"] for row in rows(found.stdout)]


@TEMPLATE_ONLY
def test_near_ties_are_where_the_runs_precision_and_fp32_differ(near_tie_run):
    """The premise of the test above, for the template's ResNet: where the run evaluated in bf16 (a CPU with native
    bf16), fp32 gives other classes on that folder (7 of 210 images on a CPU with AMX), so that computing in the run's
    precision is what makes predict.py's classes the run's. fp16 rounds 8 times finer: its probabilities differ."""
    from predict import Classifier

    checkpoint, _, found = near_tie_run
    precision = torch.load(checkpoint, weights_only=True)["precision"]
    if precision.startswith("fp32"):
        pytest.skip("the run computed in fp32 on this CPU: no other precision to differ from")
    classifier, paths = Classifier(checkpoint, device="cpu"), [row["path"] for row in rows(found.stdout)]
    in_its_precision = classifier(paths)
    classifier.precision = "fp32"
    if precision.startswith("fp16"):
        assert (classifier(paths) - in_its_precision).abs().max() > 1e-4
    else:
        assert (classifier(paths).argmax(1) != in_its_precision.argmax(1)).any()


def near_ties(classifier, test: Path, folder: Path, pairs: int = 10, steps: int = 21) -> None:
    """For each pair of the test folder's images (one of each class), blends at `steps` shares of the second around
    the share where the classifier's fp32 class changes, 1/1000 apart, labelled as classified there, as 16x16 PNGs in
    `folder`/<class>/."""
    classifier.precision = "fp32"
    firsts, seconds = (sorted((test / name).glob("[0-9]*.png"))[:pairs] for name in CLASSES.values())
    for n, (a, b) in enumerate(zip(firsts, seconds, strict=True)):
        a, b = (torch.from_numpy(data.decode(str(path), 16)).double() for path in (a, b))
        shares = torch.linspace(0, 1, 201)
        second = classifier.probabilities(blend(a, b, shares))[:, 1]
        crossing = shares[(second > 0.5).int().argmax()].item()  # the first share classified as the second class
        for k, share in enumerate(crossing + (torch.arange(steps) - steps // 2) / 1000):
            label = list(CLASSES.values())[int(share >= crossing)]
            (folder / label).mkdir(parents=True, exist_ok=True)
            Image.fromarray(blend(a, b, share.view(1))[0].numpy()).save(folder / label / f"{n:02d}-{k:02d}.png")


def blend(a: torch.Tensor, b: torch.Tensor, shares: torch.Tensor) -> torch.Tensor:
    shares = shares.double().view(-1, 1, 1, 1)
    return ((1 - shares) * a + shares * b).round().clamp(0, 255).to(torch.uint8)


def test_a_single_image_gives_one_row_and_the_python_class_the_same(trained):
    from predict import Classifier

    out, test = trained
    image = next((test / "élan").glob("*.png"))
    result = predict(out / "checkpoint.pt", image)
    [row] = rows(result.stdout)
    assert result.stderr == ""  # a file given alone has no class: no accuracy
    probabilities = Classifier(str(out / "checkpoint.pt"))([str(image)])
    assert probabilities.shape == (1, 2) and torch.allclose(probabilities.sum(1), torch.ones(1))
    classifier = Classifier(str(out / "checkpoint.pt"))
    assert row["class"] == classifier.classes[probabilities[0].argmax()]
    assert float(row["probability"]) == pytest.approx(probabilities.max().item(), abs=1e-6)


def test_the_exported_module_classifies_a_folder_as_the_module_does(trained, tmp_path):
    """README's export: Classifier.module through torch.export, saved and loaded, takes decoded images in batches of
    any size (uint8, N x IMAGE_SIZE x IMAGE_SIZE x 3) and gives the module's classes and probabilities (fp32: the
    run's evaluation where that was fp32)."""
    from predict import Classifier

    out, test = trained
    classifier = Classifier(str(out / "checkpoint.pt"), device="cpu")
    example = torch.zeros(2, classifier.image_size, classifier.image_size, 3, dtype=torch.uint8)
    program = torch.export.export(classifier.module, (example,), dynamic_shapes=({0: torch.export.Dim("batch")},))
    torch.export.save(program, tmp_path / "classifier.pt2")
    module = torch.export.load(tmp_path / "classifier.pt2").module()
    paths = [path for path, _ in data.list_folder(str(test.parent), "test")[1]]
    pixels = torch.stack([torch.from_numpy(data.decode(path, classifier.image_size)) for path in paths])
    probabilities = torch.cat([module(pixels[:1]), module(pixels[1:])])  # no gradients: Classifier has none
    expected = classifier.module(pixels)
    assert probabilities.argmax(1).tolist() == expected.argmax(1).tolist() and not classifier.module.training
    assert torch.allclose(probabilities, expected, atol=1e-5)


def test_files_that_cannot_be_decoded_in_a_folder_are_skipped_with_a_warning_that_names_them(trained, tmp_path):
    out, test = trained
    shutil.copytree(test, tmp_path / "test")
    broken = [tmp_path / "test" / "élan" / "broken.png", tmp_path / "test" / "chat noir" / "broken.jpg"]
    for path in broken:
        path.write_bytes(b"not an image")
    result = predict(out / "checkpoint.pt", tmp_path / "test")
    assert result.returncode == 0 and len(rows(result.stdout)) == 61
    warning, accuracy, *per_class = lines(result.stderr)
    assert warning == f"warning: 2 of 63 images cannot be read: {broken[1]}, {broken[0]}; skipped"
    assert accuracy.startswith("accuracy ") and accuracy.endswith(" on 60 images")  # the images it could read


def test_images_outside_class_folders_are_classified_and_not_counted(trained, tmp_path):
    """A file given, and one beside the class folders of a folder given; so is a folder given that is itself a class
    folder (the first level below it names no class)."""
    out, test = trained
    image = shutil.copy(next((test / "élan").glob("*.png")), tmp_path / "photo.png")
    result = predict(out / "checkpoint.pt", image, test)
    assert result.returncode == 0 and len(rows(result.stdout)) == 62
    assert lines(result.stderr)[0].endswith(" on 60 images")
    result = predict(out / "checkpoint.pt", image, test / "élan")
    assert result.returncode == 0 and result.stderr == "" and len(rows(result.stdout)) == 31


def test_output_cut_short_by_the_reader_ends_without_a_traceback(trained, tmp_path):
    """`predict.py ... | head -1`: the reader closes the pipe before the CSV is written."""
    out, test = trained
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    run = launch(str(out / "checkpoint.pt"), str(test), module="predict", stdout_to=str(fifo))
    open(fifo).close()  # opened once predict.py opened it for its output; closed before it writes
    run.wait(HANG_TIMEOUT)
    err = Path(run.stderr_path).read_text()
    assert run.returncode == 0 and "Traceback" not in err and lines(err)[-3].startswith("accuracy "), err


@pytest.mark.parametrize(
    "problem, words",
    [
        ("missing checkpoint", "No such file or directory"),
        ("unreadable checkpoint", "garbage.pt is no checkpoint torch reads ("),
        ("the results' CSV for a checkpoint", "pytorch_res.csv is no checkpoint torch reads ("),
        ("weights alone", "holds a network's weights alone; predict.py needs a run's checkpoint.pt"),
        ("missing path", "does not exist"),
        ("folder without images", "is no image and holds none"),
        ("another network", "holds another network than make_model builds ("),
        ("confusion into a missing folder", "--confusion "),
        ("confusion of unlabelled images", "--confusion needs images in folders named by the run's classes"),
    ],
)
def test_bad_input_is_one_line_with_exit_2(trained, tmp_path, problem, words):
    out, test = trained
    checkpoint, path, extra = out / "checkpoint.pt", test, ["--confusion", tmp_path / "confusion"]
    if problem == "confusion into a missing folder":
        extra = ["--confusion", tmp_path / "no such folder" / "confusion"]
    if problem == "confusion of unlabelled images":
        path = test / "chat noir"  # itself a class folder: the first level below it names no class
    if problem == "missing checkpoint":
        checkpoint = tmp_path / "nothing.pt"
    if problem == "unreadable checkpoint":
        checkpoint = tmp_path / "garbage.pt"
        checkpoint.write_bytes(b"garbage")
    if problem == "the results' CSV for a checkpoint":
        checkpoint = out / "pytorch_res.csv"
    if problem == "weights alone":
        checkpoint = tmp_path / "other.pt"
        torch.save(torch.load(out / "checkpoint.pt", weights_only=True)["model"], checkpoint)
    if problem == "another network":  # of the same classes: only the names and shapes of its tensors tell
        checkpoint = tmp_path / "other.pt"
        torch.save(
            {**torch.load(out / "checkpoint.pt", weights_only=True), "model": torch.nn.Linear(3, 2).state_dict()},
            checkpoint,
        )
    if problem == "missing path":
        path = tmp_path / "no such folder"
    if problem == "folder without images":
        path = tmp_path / "notes"
        path.mkdir()
        (path / "notes.txt").write_text("not an image")
    result = predict(checkpoint, path, *extra)
    assert result.returncode == 2 and result.stdout == "" and not list(tmp_path.glob("confusion*"))
    assert result.stderr.startswith("error: ") and words in result.stderr
    assert len(result.stderr.splitlines()) == 1, result.stderr


def test_the_best_checkpoint_classifies_and_its_confusion_matrix_counts_each_true_and_predicted_class(
    trained, tmp_path
):
    """best.pt is the run's checkpoint of its best epoch (the later on a tie), which predict.py reads as any; with
    --confusion, a CSV (a row per true class, a column per predicted one) and a picture of it."""
    out, test = trained
    acc = pd.read_csv(out / "pytorch_res.csv")["acc"]
    best = torch.load(out / "best.pt", weights_only=True)
    assert best["epoch"] == max(range(1, len(acc) + 1), key=lambda epoch: (acc[epoch - 1], epoch))
    assert best["history"][-1]["acc"] == acc.max() and best["epoch"] <= len(acc)
    result = predict(out / "best.pt", test, "--confusion", tmp_path / "confusion")
    assert result.returncode == 0, result.stderr
    found, matrix = rows(result.stdout), pd.read_csv(tmp_path / "confusion.csv", index_col=0)
    classes = sorted(CLASSES.values())
    assert matrix.index.tolist() == classes and matrix.columns.tolist() == classes
    for true, predicted in itertools.product(classes, classes):
        images = sum(row["true_class"] == true and row["class"] == predicted for row in found)
        assert matrix.loc[true, predicted] == images, (true, predicted, matrix)
    assert matrix.to_numpy().sum() == 60 and matrix.to_numpy().diagonal().sum() == round(acc[best["epoch"] - 1] * 60)
    with Image.open(tmp_path / "confusion.png") as picture:
        assert picture.format == "PNG" and min(picture.size) > 150


def test_one_reader_takes_a_checkpoint_or_a_state_dict_in_the_common_forms(trained, tmp_path, monkeypatch):
    """INIT_FROM's and predict.py's reader (start.read_weights): a run's checkpoint.pt, a bare state_dict (torchvision's
    form), one saved from DDP (module.) or torch.compile (_orig_mod.), one under "state_dict", and timm's .safetensors
    give the same tensors (so the same parameters load, and stay as built, as from checkpoint.pt); anything else, and
    .safetensors without its package, is one line saying what it found."""
    from safetensors.torch import save_file

    from safeguards import start
    from safeguards.failures import UserError

    weights, checkpoint = start.read_weights(str(trained[0] / "checkpoint.pt"))
    assert checkpoint is not None and checkpoint["model"].keys() == weights.keys()
    best, of_best = start.read_weights(str(trained[0] / "best.pt"))  # the best epoch's, read alike (INIT_FROM too)
    assert of_best["epoch"] <= checkpoint["epoch"] and best.keys() == weights.keys()
    forms = {
        "bare.pth": weights,
        "ddp.pth": {f"module.{name}": tensor for name, tensor in weights.items()},
        "compiled.pth": {f"_orig_mod.{name}": tensor for name, tensor in weights.items()},
        "nested.pth": {"state_dict": weights, "epoch": 3},
    }
    for name, saved in forms.items():
        torch.save(saved, tmp_path / name)
    save_file({name: tensor.contiguous() for name, tensor in weights.items()}, tmp_path / "timm.safetensors")
    for name in [*forms, "timm.safetensors"]:
        found, whole = start.read_weights(str(tmp_path / name))
        assert whole is None and found.keys() == weights.keys(), name
        assert all(torch.equal(found[key], weights[key]) for key in weights), name
    torch.save([1, 2], tmp_path / "list.pt")
    torch.save({"epoch": 3, "lr": 0.1}, tmp_path / "dict.pt")
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)  # as where the package is not installed
    for name, said in [
        ("list.pt", "INIT_FROM {} holds a list, not a network's tensors; give a run's checkpoint.pt or a state_dict "
         "file"),
        ("dict.pt", "INIT_FROM {} holds a dict with keys 'epoch', 'lr', not a network's tensors; give a run's "
         "checkpoint.pt or a state_dict file"),
        ("timm.safetensors", "INIT_FROM {} is a .safetensors file: pip install safetensors to read it"),
    ]:  # fmt: skip
        with pytest.raises(UserError) as refused:
            start.read_weights(str(tmp_path / name), "INIT_FROM ")
        assert str(refused.value) == said.format(tmp_path / name)
