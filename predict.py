"""Classify images with a run's checkpoint, prepared exactly as the run's evaluation prepared its test images.

    python predict.py output/checkpoint.pt photo.png more_photos/ > predictions.csv
    python predict.py output/best.pt images/test/ --confusion confusion > predictions.csv

Each PATH is an image file or a folder, listed as training lists one. CSV on stdout, one row per image. Where a PATH's
sub-folders name classes (a run's test/): each image's true class in the CSV, and on stderr `accuracy A on N images`,
then a line per class; --confusion PREFIX writes PREFIX.csv (rows: true class, columns: predicted) and PREFIX.png."""

import csv
import os
import sys
from types import SimpleNamespace

import pandas as pd
import torch
from matplotlib.figure import Figure

import data
import train_distribute
from data import IMAGE_EXTENSIONS
from safeguards import failures, settings, start
from safeguards.failures import UserError


class Classifier:
    """A run's network (make_model with the checkpoint's settings), weights, preprocessing (IMAGE_SIZE, the stretch,
    the normalisation, TTA), class names and precision, from its checkpoint: it computes as the run's evaluation did."""

    def __init__(self, path: str, device: str | None = None) -> None:
        weights, saved = start.read_weights(path)  # the reader INIT_FROM uses
        if saved is None:  # weights alone: no classes, image size or normalisation
            raise UserError(f"{path} holds a network's weights alone; predict.py needs a run's checkpoint.pt")
        cfg = SimpleNamespace(**{**vars(settings.read(train_distribute, [])), **saved["config"]})
        self.classes, self.image_size = list(saved["data"]["classes"]), int(saved["data"]["image_size"])
        self.precision = saved.get("precision", "bf16" if saved.get("bf16") else "fp32")  # its evaluation's
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.model = train_distribute.make_model(cfg, len(self.classes))
        if differs := start.compare_weights(self.model, weights)[1]:
            raise UserError(f"{path} holds another network than make_model builds ({differs}); use the code of the run")
        self.model.load_state_dict(weights)
        self.model.to(self.device).eval().requires_grad_(False)  # no gradients; the input channels_last, as the run
        loader = data.Loader(False, saved["data"]["mean"], saved["data"]["std"], self.device, torch.channels_last)
        self.module = Evaluation(self.model, loader, cfg.TTA).eval()  # what predict.py computes, as a module to ship

    def __call__(self, paths: list[str]) -> torch.Tensor:
        """The class probabilities of image files, one row per file."""
        return self.probabilities(torch.stack([torch.from_numpy(data.decode(p, self.image_size)) for p in paths]))

    @torch.no_grad()
    def probabilities(self, pixels: torch.Tensor) -> torch.Tensor:
        """The softmax of the logits the run's evaluation uses, for uint8 images (N, IMAGE_SIZE, IMAGE_SIZE, 3)."""
        with train_distribute.autocast(self.device, self.precision):  # .module alone: fp32
            return self.module(pixels.to(self.device)).cpu()


class Evaluation(torch.nn.Module):
    """The run's evaluation of uint8 images (N, IMAGE_SIZE, IMAGE_SIZE, 3), normalisation and TTA included, to ship."""

    def __init__(self, model: torch.nn.Module, loader: data.Loader, tta: bool) -> None:
        super().__init__()
        self.model, self.loader, self.tta = model, loader, tta
        self.register_buffer("mean", loader.mean)  # the loader's, so that an export holds them as buffers
        self.register_buffer("std", loader.std)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return train_distribute.eval_logits(self.model, self.loader.prepare(pixels), self.tta).softmax(dim=1)


def image_paths(paths: list[str]) -> dict[str, str]:
    """Every image PATH names, sorted, listed as training lists them, with its class: its first folder below a PATH."""
    found = {}
    for path in paths:
        if not os.path.exists(path):
            raise UserError(f"{path} does not exist; give image files, or folders of them")
        images = data.image_files(path) if os.path.isdir(path) else [path] * path.lower().endswith(IMAGE_EXTENSIONS)
        if not images:
            raise UserError(f"{path} is no image and holds none ({' '.join(IMAGE_EXTENSIONS)}); give images or folders")
        found |= {image: (os.path.relpath(image, path).split(os.sep)[:-1] or [""])[0] for image in images}
    return dict(sorted(found.items()))


def main(argv: list[str]) -> int:
    at = argv.index("--confusion") if "--confusion" in argv else -1  # --confusion PREFIX, anywhere
    confusion, argv = (argv[at + 1 : at + 2], argv[:at] + argv[at + 2 :]) if at >= 0 else ([""], argv)
    if len(argv) < 2 or argv[0] in ("-h", "--help") or not confusion:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    try:
        classifier, listed = Classifier(argv[0]), image_paths(argv[1:])
        files = data.ImageFiles([(p, 0) for p in listed], classifier.image_size)
        batches = data.reader(files, 256, None, workers=0, pin=False)  # 256 images a pass; the unreadable: marked
        probabilities, marks = zip(*[(classifier.probabilities(x), marked) for x, _, marked in batches], strict=True)
        readable = (torch.cat(marks) < 0).tolist()
        found = [(path, p) for path, p, ok in zip(listed, torch.cat(probabilities), readable, strict=True) if ok]
        if not found:
            raise UserError("none of the images could be read; give image files that open as images")
        if skipped := [i for i, ok in enumerate(readable) if not ok]:
            print(f"warning: {files.unreadable(skipped)}; skipped", file=sys.stderr)
        truth = {path: name for path, name in listed.items() if name in classifier.classes}  # a class folder's images
        rows = [[path, classifier.classes[p.argmax()], f"{p.max():.6f}", truth.get(path, "")] for path, p in found]
        labelled = pd.DataFrame([row[1::2] for row in rows if row[3]], columns=["predicted", "true"], dtype=str)
        if confusion[0]:  # before any output: a mistake writes nothing
            write_confusion(labelled, classifier.classes, confusion[0])
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if len(right := labelled["predicted"] == labelled["true"]):
        print(f"accuracy {right.mean():.4f} on {len(right):,} images", file=sys.stderr)
        for name, of_class in right.groupby(labelled["true"]):  # which classes fail
            print(f"class {name}: accuracy {of_class.mean():.4f} on {len(of_class):,} images", file=sys.stderr)
    failures.survive_closed_stdout()  # `predict.py ... | head`: the reader has what it wanted
    csv.writer(sys.stdout, lineterminator="\n").writerows([["path", "class", "probability", "true_class"], *rows])
    return 0


def write_confusion(labelled: pd.DataFrame, classes: list[str], prefix: str) -> None:
    """PREFIX.csv: the images of each true class (rows) given each class (columns); PREFIX.png: the same, drawn."""
    if not len(labelled):
        raise UserError("--confusion needs images in folders named by the run's classes (a run's test/); give those")
    if not os.access(folder := os.path.dirname(os.path.abspath(prefix)), os.W_OK):
        raise UserError(f"--confusion {prefix}: cannot write into {folder}; give a PREFIX in a writable folder")
    true, predicted = (pd.Categorical(labelled[key], categories=classes) for key in ("true", "predicted"))
    counts = pd.crosstab(true, predicted, rownames=["true"], colnames=["predicted"], dropna=False)
    counts.to_csv(f"{prefix}.csv")
    figure = Figure(figsize=(2 + 0.5 * len(classes), 1.5 + 0.5 * len(classes)))
    axes = figure.add_subplot(xlabel="predicted", ylabel="true", title="Confusion matrix (images)")
    axes.imshow(counts.to_numpy(), cmap="Blues")
    axes.set_xticks(range(len(classes)), classes, rotation=90)
    axes.set_yticks(range(len(classes)), classes)
    for (true, predicted), count in counts.stack().items():  # each cell's count, written on it
        axes.text(classes.index(predicted), classes.index(true), count, ha="center", va="center", color="grey")
    figure.savefig(f"{prefix}.png", dpi=110, bbox_inches="tight")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
