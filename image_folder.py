"""An image folder (DATA_DIR/train/<class>/<image>, DATA_DIR/test/...) read once per machine: every image decoded,
checked and stretched to the square if it is not, on all cores, into one cache file with its channel statistics,
which later runs and the other ranks load in a fraction of a second. Part of data.py's readers."""

import hashlib
import multiprocessing
import os
import sys
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from typing import Any

import torch

import outputs
from distribute_tools import cpu_cores
from processes import UserError, first_line

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
CACHE_FORMAT = 2  # bump when the cache's content changes meaning
DECODE_CHUNK = 2_000  # images per decoding task


def decoded(root: str, size: int) -> dict[str, Any]:
    """The image folder `root` as data.ImageSet's fields: images, labels, classes, mean, std, resized."""
    path = ensure_decoded(root, size)
    try:
        return torch.load(path, weights_only=True)
    except (OSError, RuntimeError) as e:
        raise UserError(f"the decoded copy {path} cannot be read ({type(e).__name__}); delete it and rerun") from None


def check_same_classes(data_dir: str, train: list[str], test: list[str]) -> None:
    if train != test:
        only = {"train": sorted(set(train) - set(test)), "test": sorted(set(test) - set(train))}
        parts = "; ".join(f"only in {split}/: {', '.join(names)}" for split, names in only.items() if names)
        raise UserError(
            f"{data_dir}/train and {data_dir}/test hold different class folders ({parts}); give both the same "
            f"class folders"
        )


def list_images(root: str) -> tuple[list[str], list[tuple[str, int]]]:
    """Class names (sorted sub-folder names; hidden folders such as .ipynb_checkpoints are skipped) and (path,
    label) of every image file. Raises UserError for a missing folder, an empty class or a broken link."""
    parent = os.path.dirname(root)
    if not os.path.isdir(root):
        problem = "is a file, not a folder" if os.path.isfile(parent) else "does not exist"
        problem = f"has no {os.path.basename(root)}/ folder" if os.path.isdir(parent) else problem
        raise UserError(
            f"DATA_DIR {parent} {problem}; point --data_dir at a folder with {parent}/train/<class>/<image> and "
            f"test/<class>/<image> inside"
        )
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith("."))
    if not classes:
        raise UserError(f"{root} holds no class folders; put one sub-folder per class in it, with the images inside")
    samples = []
    for label, name in enumerate(classes):
        files = sorted(f for f in os.listdir(os.path.join(root, name)) if f.lower().endswith(IMAGE_EXTENSIONS))
        if not files:
            raise UserError(
                f"{os.path.join(root, name)} holds no images ({', '.join(IMAGE_EXTENSIONS[:3])}, ...); put the "
                f"class's images in it or remove the folder"
            )
        samples += [(os.path.join(root, name, f), label) for f in files]
    broken = [path for path, _ in samples if not os.path.exists(path)]
    if broken:
        raise UserError(
            f"{len(broken)} file(s) in {root} are links to files that do not exist: {', '.join(broken[:3])}"
            f"{' and more' if len(broken) > 3 else ''}; delete or replace them and rerun"
        )
    return classes, samples


def ensure_decoded(root: str, size: int) -> str:
    """Decode the image folder `root` into its cache file unless one for its current files exists; returns that
    file. The cache is keyed by the image size and every file's path, size and modification time; the first
    process decodes (under a file lock: the other ranks and machines sharing the folder wait instead)."""
    classes, samples = list_images(root)
    path = _cache_path(root, _cache_key(root, size, classes, samples))
    with outputs.lock_file(os.path.join(os.path.dirname(path), f"{os.path.basename(root)}.lock")):
        if not os.path.exists(path):  # written by a rename: if it is there, it is whole
            images, resized = decode_images([p for p, _ in samples], root, size)
            mean, std = channel_statistics(images)
            labels = torch.tensor([label for _, label in samples], dtype=torch.int64)
            fields = {"images": images, "labels": labels, "classes": classes, "resized": resized}
            _write_cache(path, {**fields, "mean": mean, "std": std})
    return path


def decode_images(paths: list[str], root: str, size: int) -> tuple[torch.Tensor, int]:
    """Every image as 3 x size x size uint8 (others stretched to the square, antialiased), decoded in chunks on
    all cores, and how many were resized. Every file is checked: unreadable ones are named in one UserError (a
    data set is refused rather than silently shrunk, and the user learns which files to replace)."""
    chunks = [(paths[start : start + DECODE_CHUNK], size) for start in range(0, len(paths), DECODE_CHUNK)]
    with _decoding_pool(len(chunks)) as pool:
        decoded = list(pool.map(_decode_chunk, chunks))
    problems = [problem for _, chunk_problems, _ in decoded for problem in chunk_problems]
    if problems:
        named = "; ".join(problems[:3]) + (f"; and {len(problems) - 3} more" if len(problems) > 3 else "")
        raise UserError(
            f"{len(problems)} of {len(paths)} images in {root} cannot be read: {named}; delete or replace "
            f"{'it' if len(problems) == 1 else 'them'} and rerun"
        )
    images = torch.frombuffer(bytearray(b"".join(pixels for pixels, _, _ in decoded)), dtype=torch.uint8)
    return images.view(len(paths), 3, size, size), sum(resized for _, _, resized in decoded)


def _decoding_pool(chunks: int) -> Executor:
    """Processes on Linux (decoding small images is mostly Python work, which threads cannot share out);
    forked, so that they start at once without importing torch again. A thread elsewhere."""
    if chunks > 1 and cpu_cores() > 1 and sys.platform.startswith("linux"):
        return ProcessPoolExecutor(min(cpu_cores(), chunks), mp_context=multiprocessing.get_context("fork"))
    return ThreadPoolExecutor(1)


def _decode_chunk(job: tuple[list[str], int]) -> tuple[bytes, list[str], int]:
    """Pixels of each image, channels first, as bytes; "path (reason)" for each unreadable one; how many
    were resized."""
    import numpy as np
    from PIL import Image

    paths, size = job
    pixels, problems, resized = [], [], 0
    for path in paths:
        try:
            with Image.open(path) as image:
                image = image.convert("RGB")
                if image.size != (size, size):
                    image, resized = image.resize((size, size), Image.BILINEAR), resized + 1  # antialiased
                pixels.append(np.asarray(image).transpose(2, 0, 1).tobytes())
        except Exception as e:  # truncated, not an image, unsupported: the file is named, whatever the cause
            problems.append(f"{path} ({first_line(e, 80)})")
            pixels.append(bytes(3 * size * size))
    return b"".join(pixels), problems, resized


def channel_statistics(images: torch.Tensor) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and standard deviation of uint8 images, in 0..1 units (in chunks: no float copy of it all)."""
    sums = torch.zeros(2, 3, dtype=torch.float64)
    for chunk in images.split(4096):
        x = chunk.transpose(0, 1).reshape(3, -1).double() / 255
        sums += torch.stack([x.sum(dim=1), (x * x).sum(dim=1)])
    count = images.numel() / 3
    mean = sums[0] / count
    std = (sums[1] / count - mean**2).clamp(min=1e-12).sqrt()
    return tuple(mean.tolist()), tuple(std.tolist())


def _cache_key(root: str, size: int, classes: list[str], samples: list[tuple[str, int]]) -> str:
    digest = hashlib.sha256(f"{CACHE_FORMAT} {size} {classes}".encode())
    for path, label in samples:
        stat = os.stat(path)
        digest.update(f"{os.path.relpath(path, root)} {label} {stat.st_size} {stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:16]


def _cache_path(root: str, key: str) -> str:
    """Beside the data (DATA_DIR/.decoded/) where that is writable, else in the user's cache folder."""
    folder = os.path.join(os.path.dirname(os.path.abspath(root)), ".decoded")
    try:
        os.makedirs(folder, exist_ok=True)
        if not os.access(folder, os.W_OK):
            raise OSError
    except OSError:
        user_cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        folder = os.path.join(user_cache, "resnet-ddp", hashlib.sha256(os.path.abspath(root).encode()).hexdigest()[:12])
        os.makedirs(folder, exist_ok=True)
    return os.path.join(folder, f"{os.path.basename(root)}-{key}.pt")


def _write_cache(path: str, content: dict) -> None:
    """Atomically, replacing the caches of earlier versions of the folder."""
    split, folder = os.path.basename(path).rsplit("-", 1)[0], os.path.dirname(path)
    for name in os.listdir(folder):
        if name.startswith(f"{split}-") and name.endswith(".pt"):
            os.remove(os.path.join(folder, name))
    outputs.write_atomically(path, lambda temporary: torch.save(content, temporary))
