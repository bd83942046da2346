"""predict.py: a run's checkpoint classifies image files as the run's evaluation did, as CSV on stdout; bad input is
one line with exit 2."""

import csv
import io
import itertools
import os
import shutil
import subprocess
from pathlib import Path

import pandas as pd
import pytest
import torch

import data
import train_distribute
from tests.conftest import HANG_TIMEOUT, TINY, image_folder_of_noise, launch, read_config, run_script

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
    the reference run's network (10 classes; here 2): every tensor but the classifier's last layer comes from there.
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
    init_from = reference_run[0] / "checkpoint.pt"
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


def test_predict_on_the_runs_own_test_folder_gives_its_final_accuracy(trained):
    """Over exactly the images the run evaluated (training's listing: the nested one counted under its class, the
    hidden ones skipped without a word, the one beside the class folders classified but not counted). In fp32 where
    the run evaluated in bf16 (on a CPU with native bf16): within one image of the run's."""
    out, test = trained
    result = predict(out / "checkpoint.pt", test)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("path,class,probability\n")
    found = rows(result.stdout)
    evaluated = [path for path, _ in data.list_folder(str(test.parent), "test")[1]]
    assert (
        len(evaluated) == 60
        and ", 60 test images of " in torch.load(out / "checkpoint.pt", weights_only=True)["data"]["identity"]
    )
    assert [row["path"] for row in found] == sorted([*evaluated, str(test / "beside.png")])
    assert all(0.5 <= float(row["probability"]) <= 1 for row in found)  # the likeliest of two classes
    right = sum(Path(row["path"]).relative_to(test).parts[0] == row["class"] for row in found)
    assert lines(result.stderr) == [f"accuracy {right / 60:.4f} on 60 images"]
    final = pd.read_csv(out / "pytorch_res.csv")["acc"].iloc[-1]
    assert abs(right - final * 60) <= 1, (right, final)


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


def test_the_exported_module_classifies_a_folder_as_predict_does(trained, tmp_path):
    """README's export: Classifier.module through torch.export, saved and loaded, takes decoded images in batches of
    any size (uint8, N x IMAGE_SIZE x IMAGE_SIZE x 3) and gives predict.py's classes and probabilities."""
    from predict import Classifier

    out, test = trained
    classifier = Classifier(str(out / "checkpoint.pt"), device="cpu")
    example = torch.zeros(2, classifier.image_size, classifier.image_size, 3, dtype=torch.uint8)
    program = torch.export.export(classifier.module, (example,), dynamic_shapes=({0: torch.export.Dim("batch")},))
    torch.export.save(program, tmp_path / "classifier.pt2")
    module = torch.export.load(tmp_path / "classifier.pt2").module()
    found = rows(predict(out / "checkpoint.pt", test).stdout)
    pixels = torch.stack([torch.from_numpy(data.decode(row["path"], classifier.image_size)) for row in found])
    probabilities = torch.cat([module(pixels[:1]), module(pixels[1:])])  # no gradients: Classifier has none
    assert [classifier.classes[i] for i in probabilities.argmax(1)] == [row["class"] for row in found]
    assert probabilities.max(1).values.tolist() == pytest.approx([float(row["probability"]) for row in found], abs=1e-5)


def test_a_file_that_cannot_be_decoded_in_a_folder_is_skipped_with_a_warning_that_counts_it(trained, tmp_path):
    out, test = trained
    shutil.copytree(test, tmp_path / "test")
    (tmp_path / "test" / "élan" / "broken.png").write_bytes(b"not a png")
    result = predict(out / "checkpoint.pt", tmp_path / "test")
    assert result.returncode == 0 and len(rows(result.stdout)) == 61
    warning, accuracy = lines(result.stderr)
    assert warning == f"warning: skipped 1 file(s) that are no images: {tmp_path / 'test' / 'élan' / 'broken.png'}"
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
    assert run.returncode == 0 and "Traceback" not in err and lines(err)[-1].startswith("accuracy "), err


@pytest.mark.parametrize(
    "problem, words",
    [
        ("missing checkpoint", "No such file or directory"),
        ("unreadable checkpoint", "cannot read"),
        ("not our checkpoint", "is not a checkpoint of train_distribute.py"),
        ("missing path", "does not exist"),
        ("folder without images", "is no image and holds none"),
        ("another network", "holds another network than make_model builds ("),
    ],
)
def test_bad_input_is_one_line_with_exit_2(trained, tmp_path, problem, words):
    out, test = trained
    checkpoint, path = out / "checkpoint.pt", test
    if problem == "missing checkpoint":
        checkpoint = tmp_path / "nothing.pt"
    if problem == "unreadable checkpoint":
        checkpoint = tmp_path / "garbage.pt"
        checkpoint.write_bytes(b"garbage")
    if problem == "not our checkpoint":
        checkpoint = tmp_path / "other.pt"
        torch.save({"state_dict": {}}, checkpoint)
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
    result = predict(checkpoint, path)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith("error: ") and words in result.stderr
    assert len(result.stderr.splitlines()) == 1, result.stderr
