"""predict.py: a run's checkpoint classifies image files as the run's evaluation did, as CSV on stdout; bad input is
one line with exit 2."""

import csv
import io
import os
import shutil
import subprocess
from pathlib import Path

import pandas as pd
import pytest
import torch

from tests.conftest import HANG_TIMEOUT, SETTINGS, TINY, image_folder_of_noise, launch, run_script

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
    the reference run's network (10 classes; here 2): every tensor but the head's comes from there."""
    tmp = tmp_path_factory.mktemp("predict")
    image_folder_of_noise(tmp / "images", train=300, test=60, size=20, brighter=25)
    for split in ("train", "test"):
        for old, new in CLASSES.items():
            (tmp / "images" / split / old).rename(tmp / "images" / split / new)
    settings = [
        "--dataset=imagefolder",
        f"--data_dir={tmp / 'images'}",
        "--image_size=16",
        "--epochs=6",
        "--num_workers=0",
    ]
    init_from = reference_run[0] / "checkpoint.pt"
    result = run_script(*TINY, *settings, f"--init_from={init_from}", f"--output_dir={tmp / 'out'}")
    assert result.returncode == 0, result.stderr
    first, fine_tuning, *_ = lines(result.stdout)
    assert "images on imagefolder (20x20 stretched to 16x16) |" in first, first
    if "WIDTH" in SETTINGS:  # the template's ResNet: what is left as built is named (a swapped network has its own)
        loaded = len(torch.load(init_from, weights_only=True)["model"]) - 2
        assert fine_tuning == (
            f"fine-tuning from {init_from}: {loaded} of {loaded + 2} tensors loaded; left as built (no tensor of that "
            "name and shape): head.weight, head.bias"
        )
    assert fine_tuning.startswith(f"fine-tuning from {init_from}: ")
    assert pd.read_csv(tmp / "out" / "pytorch_res.csv")["epoch"].tolist() == [1, 2, 3, 4, 5, 6]  # epochs start anew
    return tmp / "out", tmp / "images" / "test"


def lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def rows(stdout: str) -> list[dict]:
    return list(csv.DictReader(io.StringIO(stdout)))


def test_predict_on_the_runs_own_test_folder_gives_its_final_accuracy(trained):
    """In fp32 where the run evaluated in bf16 (on a CPU with native bf16): within one image of the run's."""
    out, test = trained
    result = predict(out / "checkpoint.pt", test)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("path,class,probability\n")
    found = rows(result.stdout)
    assert [row["path"] for row in found] == sorted(str(p) for p in test.rglob("*.png"))
    assert all(0.5 <= float(row["probability"]) <= 1 for row in found)  # the likeliest of two classes
    right = sum(Path(row["path"]).parent.name == row["class"] for row in found)
    assert lines(result.stderr) == [f"accuracy {right / 60:.4f} on 60 images"]
    final = pd.read_csv(out / "pytorch_res.csv")["acc"].iloc[-1]
    assert abs(right - final * len(found)) <= 1, (right, final)


def test_a_single_image_gives_one_row_and_the_python_class_the_same(trained):
    from predict import Classifier

    out, test = trained
    image = next((test / "élan").glob("*.png"))
    [row] = rows(predict(out / "checkpoint.pt", image).stdout)
    probabilities = Classifier(str(out / "checkpoint.pt"))([str(image)])
    assert probabilities.shape == (1, 2) and torch.allclose(probabilities.sum(1), torch.ones(1))
    classifier = Classifier(str(out / "checkpoint.pt"))
    assert row["class"] == classifier.classes[probabilities[0].argmax()]
    assert float(row["probability"]) == pytest.approx(probabilities.max().item(), abs=1e-6)


def test_a_file_that_cannot_be_decoded_in_a_folder_is_skipped_with_a_warning_that_counts_it(trained, tmp_path):
    out, test = trained
    shutil.copytree(test, tmp_path / "test")
    (tmp_path / "test" / "élan" / "broken.png").write_bytes(b"not a png")
    result = predict(out / "checkpoint.pt", tmp_path / "test")
    assert result.returncode == 0 and len(rows(result.stdout)) == 60
    warning, accuracy = lines(result.stderr)
    assert warning == f"warning: skipped 1 file(s) that are no images: {tmp_path / 'test' / 'élan' / 'broken.png'}"
    assert accuracy.startswith("accuracy ") and accuracy.endswith(" on 60 images")  # the images it could read


def test_images_outside_class_folders_give_no_accuracy(trained, tmp_path):
    out, test = trained
    image = shutil.copy(next((test / "élan").glob("*.png")), tmp_path / "photo.png")
    result = predict(out / "checkpoint.pt", image, test)
    assert result.returncode == 0 and result.stderr == "" and len(rows(result.stdout)) == 61


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
