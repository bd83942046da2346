"""An image folder (DATA_DIR/train/<class>/<image>, DATA_DIR/test/...): its files, their identity and statistics,
and two ways to read them. Part of data.py's readers.

    memory   every image decoded once per machine, checked and stretched to the square if it is not, on all cores,
             into one cache file, which later runs and the other ranks load in a fraction of a second
    stream   `ImageFiles`, a Dataset that DataLoader worker processes read batch by batch, straight from the files

Both decode an image the same way (`decode`), so a run may switch between them on resume."""

import hashlib
import multiprocessing
import os
import shutil
import signal
import sys
import warnings
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
from PIL import Image

import outputs
import processes
from distribute_tools import cpu_cores
from processes import UserError, first_line

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
CACHE_FORMAT = 2  # bump when the cache's content changes meaning
DECODE_CHUNK = 2_000  # images per decoding task
STATISTICS_SAMPLE = 2_000  # training images, drawn with a fixed seed, that the normalisation statistics come from
SIXTEEN_BIT = ("I;16", "I;16B", "I;16L", "I;16N", "I")  # grey modes of 16-bit files (older Pillow opens them as I)
Samples = list[tuple[str, int]]  # (path, label) of every image of a split


def decoded(root: str, size: int) -> dict[str, Any]:
    """The image folder `root` as data.ImageSet's fields: images, labels, classes, resized."""
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
            f"{data_dir}/train and {data_dir}/test hold different class folders ({parts}); every class needs "
            f"images in both: add the missing class folders with some images, or move the class out of both"
        )


def list_images(root: str) -> tuple[list[str], Samples, int]:
    """Class names (sorted sub-folder names; hidden folders such as .ipynb_checkpoints are skipped), (path, label)
    of every image file, and how many entries of the class folders are skipped (other files, sub-folders).
    Raises UserError for a missing folder, an empty class or a broken link."""
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
    samples, skipped = [], 0
    for label, name in enumerate(classes):
        entries = os.listdir(os.path.join(root, name))
        files = sorted(f for f in entries if f.lower().endswith(IMAGE_EXTENSIONS))
        skipped += len(entries) - len(files)
        if not files:
            raise UserError(
                f"{os.path.join(root, name)} holds no images ({', '.join(IMAGE_EXTENSIONS[:3])}, ...); every class "
                f"needs images in both train/ and test/: put some of the class's images in it, or move the class "
                f"out of both"
            )
        samples += [(os.path.join(root, name, f), label) for f in files]
    broken = [path for path, _ in samples if not os.path.exists(path)]
    if broken:
        raise UserError(
            f"{len(broken)} file(s) in {root} are links to files that do not exist: {', '.join(broken[:3])}"
            f"{' and more' if len(broken) > 3 else ''}; delete or replace them and rerun"
        )
    return classes, samples, skipped


def identity(splits: list[tuple[str, Samples]]) -> str:
    """What tells one image folder from another without reading an image: every file's name, class and size (not
    its time: copies of a folder on other machines must agree). A file replaced by another of the same name and
    size is not noticed."""
    digest = hashlib.sha256()
    for root, samples in splits:
        for path, label in samples:
            digest.update(f"{os.path.relpath(path, root)} {label} {os.path.getsize(path)}\n".encode())
    return f"files {digest.hexdigest()[:16]}"


def statistics_sample(train_images: int) -> list[int]:
    """The training images the normalisation statistics come from: the same ones on every rank and every run."""
    order = torch.randperm(train_images, generator=torch.Generator().manual_seed(0))
    return sorted(order[:STATISTICS_SAMPLE].tolist())


def ensure_decoded(root: str, size: int) -> str:
    """Decode the image folder `root` into its cache file unless one for its current files exists; returns that
    file. The cache is keyed by the image size and every file's path, size and modification time; the first
    process decodes (under a file lock: the other ranks and machines sharing the folder wait instead)."""
    classes, samples, _ = list_images(root)
    name, folders = f"{os.path.basename(root)}-{_cache_key(root, size, classes, samples)}.pt", _cache_folders(root)
    for path in [os.path.join(folder, name) for folder in folders]:
        if os.path.exists(path):  # written by a rename: if it is there, it is whole (and read-only is enough)
            return path
    folder = _folder_for_cache(folders, root, len(samples) * 3 * size * size)
    path = os.path.join(folder, name)
    with outputs.lock_file(os.path.join(folder, f"{os.path.basename(root)}.lock")):
        if not os.path.exists(path):
            images, resized = decode_images([p for p, _ in samples], root, size)
            labels = torch.tensor([label for _, label in samples], dtype=torch.int64)
            _write_cache(path, {"images": images, "labels": labels, "classes": classes, "resized": resized}, root)
    return path


def decode_images(paths: list[str], root: str, size: int) -> tuple[torch.Tensor, int]:
    """Every image as 3 x size x size uint8 (others stretched to the square, antialiased), decoded in chunks on
    all cores, and how many were resized. Every file is checked: unreadable ones are named in one UserError (a
    data set is refused rather than silently shrunk, and the user learns which files to replace)."""
    decoded = _on_all_cores(_decode_chunk, paths, size)
    _refuse_unreadable([problem for _, chunk_problems, _ in decoded for problem in chunk_problems], len(paths), root)
    images = torch.frombuffer(bytearray(b"".join(pixels for pixels, _, _ in decoded)), dtype=torch.uint8)
    return images.view(len(paths), 3, size, size), sum(resized for _, _, resized in decoded)


def check_headers(root: str) -> None:
    """Open every image of the folder `root` as far as its header, on all cores (the stream loader's check before
    training, a fraction of a full decode); unreadable files are named in one UserError. Pillow's warnings (a
    huge image, odd metadata) are one line naming the first file: those images are used."""
    paths = [path for path, _ in list_images(root)[1]]
    chunks = _on_all_cores(_header_chunk, paths, 0)
    _refuse_unreadable([problem for problems, _ in chunks for problem in problems], len(paths), root)
    warned = [warning for _, warnings_of_chunk in chunks for warning in warnings_of_chunk]
    if warned:
        print(
            f"warning: Pillow warned about {len(warned)} of {len(paths):,} images in {root} as it opened them, "
            f"first {warned[0]}; they are used as Pillow decodes them",
            flush=True,
        )


def unreadable(problems: list[str], total: int, root: str) -> str:
    named = "; ".join(problems[:3]) + (f"; and {len(problems) - 3} more" if len(problems) > 3 else "")
    return f"{len(problems)} of {total:,} images in {root} cannot be read: {named}"


def _refuse_unreadable(problems: list[str], total: int, root: str) -> None:
    """A data set is refused rather than silently shrunk, and the user learns which files to replace."""
    if problems:
        raise UserError(
            f"{unreadable(problems, total, root)}; delete or replace {'it' if len(problems) == 1 else 'them'} and rerun"
        )


def _on_all_cores(job: Any, paths: list[str], size: int) -> list[Any]:
    chunks = [(paths[start : start + DECODE_CHUNK], size) for start in range(0, len(paths), DECODE_CHUNK)]
    pool = _decoding_pool(len(chunks))
    try:
        with processes.stop_signals_held():  # the pool's processes start as the tasks are handed out
            results = pool.map(job, chunks)
        return list(results)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)  # a stop does not wait for the chunks being decoded


def _decoding_pool(chunks: int) -> Executor:
    """Processes on Linux (decoding small images is mostly Python work, which threads cannot share out);
    forked, so that they start at once without importing torch again. A thread elsewhere."""
    if chunks > 1 and cpu_cores() > 1 and sys.platform.startswith("linux"):
        context = multiprocessing.get_context("fork")  # stopping is left to the rank or launcher that forked them
        return ProcessPoolExecutor(min(cpu_cores(), chunks), context, initializer=quiet_worker, initargs=(0,))
    return ThreadPoolExecutor(1)


def _decode_chunk(job: tuple[list[str], int]) -> tuple[bytes, list[str], int]:
    """Pixels of each image, channels first, as bytes; "path (reason)" for each unreadable one; how many
    were resized."""
    paths, size = job
    pixels, problems, resized = [], [], 0
    for path in paths:
        try:
            image, was_resized = decode(path, size)
            pixels.append(image.transpose(2, 0, 1).tobytes())
            resized += was_resized
        except Exception as e:  # truncated, not an image, unsupported: the file is named, whatever the cause
            problems.append(f"{path} ({first_line(e, 80)})")
            pixels.append(bytes(3 * size * size))
    return b"".join(pixels), problems, resized


def _header_chunk(job: tuple[list[str], int]) -> tuple[list[str], list[str]]:
    """ "path (reason)" of each file whose header cannot be read, and "path (warning)" of each Pillow warned about
    (recorded, never raised: PYTHONWARNINGS=error must not make an image unreadable)."""
    problems, warned = [], []
    for path in job[0]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                with Image.open(path) as image:
                    image.size  # noqa: B018  (read from the header)
            except Exception as e:
                problems.append(f"{path} ({first_line(e, 80)})")
        warned += [f"{path} ({str(w.message).strip()[:80]})" for w in caught[:1]]
    return problems, warned


def decode(path: str, size: int) -> tuple[np.ndarray, bool]:
    """The image file `path` as size x size x 3 uint8 RGB (stretched to the square, antialiased, if it is not),
    and whether it was resized. 16-bit grey keeps its levels (Pillow's RGB conversion clips them to white);
    palette images go through RGBA (their transparency, otherwise a warning)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # named once by check_headers; never an error (PYTHONWARNINGS=error)
        with Image.open(path) as image:
            if image.mode in SIXTEEN_BIT:
                levels = np.asarray(image).astype(np.float64).clip(0, 65535) / 257  # 0..65535 -> 0..255
                image = Image.fromarray(levels.round().astype(np.uint8), "L")
            elif image.mode in ("P", "PA"):
                image = image.convert("RGBA")
            image = image.convert("RGB")
    resized = image.size != (size, size)
    if resized:
        image = image.resize((size, size), Image.BILINEAR)
    return np.asarray(image), resized


class ImageFiles(torch.utils.data.Dataset):
    """A split read from its files: the stream loader's DataLoader workers decode a batch of them at a time. A
    file that cannot be decoded becomes a black image, and its name goes with the batch: the ranks then stop
    together (loaders.StreamLoader) instead of one worker's traceback stopping one rank. Paths and labels are
    numpy arrays: one block each, which forked workers share (Python lists' reference counts would copy them)."""

    def __init__(self, samples: Samples, size: int) -> None:
        self.paths = np.array([os.fsencode(path) for path, _ in samples])  # bytes: 1 byte per character, not 4
        self.labels, self.size = np.array([label for _, label in samples], dtype=np.int64), size

    def __len__(self) -> int:
        return len(self.paths)

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
        """(uint8 images (B, size, size, 3), int64 labels, "path (reason)" of each file that cannot be decoded)."""
        pixels, problems = np.zeros((len(indices), self.size, self.size, 3), np.uint8), []
        for row, index in enumerate(indices):
            try:
                pixels[row] = decode(os.fsdecode(self.paths[index]), self.size)[0]
            except Exception as e:  # whatever the cause, the file is named
                problems.append(f"{os.fsdecode(self.paths[index])} ({first_line(e, 80)})")
        return torch.from_numpy(pixels), torch.from_numpy(self.labels[indices]), problems


def whole_batch(batch: Any) -> Any:
    """The DataLoader's collate_fn: ImageFiles.__getitems__ returns whole batches."""
    return batch


def quiet_worker(worker_id: int) -> None:
    """A worker process (DataLoader's, or a decoding pool's) leaves stopping to the process that forked it, which
    held the stop signals back while it did (processes.stop_signals_held). A Ctrl-C reaches every process of the
    terminal and scancel every process of the job: it ignores them, but for SIGTERM, at which it leaves with exit
    code 0 once its queues are flushed (its rank then sees no failed worker, and multiprocessing ends workers so
    as a rank exits). It dies with its rank, however that ends."""
    processes.ignore_stop_signals()
    signal.signal(signal.SIGTERM, _leave_quietly)
    processes.die_with_parent(None)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, processes.STOP_SIGNALS + (processes.CANCEL_SIGNAL,))


def _leave_quietly(signum: int, frame: Any) -> None:
    raise SystemExit(0)  # through multiprocessing's exit: what the worker was sending is sent whole


def channel_statistics(images: torch.Tensor) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and standard deviation of uint8 images (N, 3, H, W), in 0..1 units."""
    return statistics(pixel_sums(images.permute(0, 2, 3, 1)))


def pixel_sums(images: torch.Tensor) -> torch.Tensor:
    """Per channel: pixels, their sum and their sum of squares, of uint8 images (N, H, W, 3), as exact integers (in
    chunks: no wide copy of it all). Sums of parts add up to the sums of the whole, in any order."""
    sums = torch.zeros(3, 3, dtype=torch.int64, device=images.device)
    for chunk in images.split(1024):
        x = chunk.reshape(-1, 3).long()
        sums += torch.stack([torch.full((3,), len(x), device=x.device), x.sum(dim=0), (x * x).sum(dim=0)])
    return sums


def statistics(sums: torch.Tensor) -> tuple[tuple[float, ...], tuple[float, ...]]:
    count, total, squares = sums.double().cpu() / torch.tensor([1.0, 255, 255**2]).view(3, 1)
    mean = total / count
    std = (squares / count - mean**2).clamp(min=1e-12).sqrt()
    return tuple(mean.tolist()), tuple(std.tolist())


def _cache_key(root: str, size: int, classes: list[str], samples: list[tuple[str, int]]) -> str:
    digest = hashlib.sha256(f"{CACHE_FORMAT} {size} {classes}".encode())
    for path, label in samples:
        stat = os.stat(path)
        digest.update(f"{os.path.relpath(path, root)} {label} {stat.st_size} {stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:16]


def _cache_folders(root: str) -> list[str]:
    """Where the decoded copy of `root` may be: beside the data (DATA_DIR/.decoded/), else in the user's cache
    folder (XDG_CACHE_HOME, or ~/.cache where there is a home)."""
    folders = [os.path.join(os.path.dirname(os.path.abspath(root)), ".decoded")]
    user_cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    if os.path.isabs(user_cache):  # "~" stays "~" without HOME or an entry in the user database
        folders.append(
            os.path.join(user_cache, "resnet-ddp", hashlib.sha256(os.path.abspath(root).encode()).hexdigest()[:12])
        )
    return folders


def _folder_for_cache(folders: list[str], root: str, size: int) -> str:
    """The first of `folders` that can be written and has room for a copy of `size` bytes (and 64 MB to spare)."""
    reasons = []
    for folder in folders:
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as e:
            reasons.append(f"{folder}: {e.strerror}")
            continue
        free = shutil.disk_usage(folder).free
        if not os.access(folder, os.W_OK):
            reasons.append(f"{folder}: not writable")
        elif free >= size + 2**26:
            return folder
        else:
            reasons.append(f"{folder}: {free / 2**20:,.0f} MB free, {(size + 2**26) / 2**20:,.0f} MB needed")
    raise UserError(
        f"no folder can take the decoded copy of {root} that the memory loader reads ({'; '.join(reasons)}); free "
        f"space, set XDG_CACHE_HOME to a writable folder with room, or use --loader stream, which needs no copy"
    )


def _write_cache(path: str, content: dict, root: str) -> None:
    """Atomically, replacing the caches of earlier versions of the folder. A failed write is one line."""
    split, folder = os.path.basename(path).rsplit("-", 1)[0], os.path.dirname(path)
    try:
        for name in os.listdir(folder):
            if name.startswith(f"{split}-") and name.endswith(".pt"):
                os.remove(os.path.join(folder, name))
        outputs.write_atomically(path, lambda temporary: torch.save(content, temporary))
    except (OSError, RuntimeError) as e:  # torch.save reports a full disk as "iostream error"
        full = shutil.disk_usage(folder).free < 2**26
        reason = "No space left on device" if full else getattr(e, "strerror", None) or first_line(e, 80)
        raise UserError(
            f"could not write the decoded copy of {root} to {path} ({reason}); free space there, set XDG_CACHE_HOME "
            f"to a folder with room, or use --loader stream, which needs no copy"
        ) from None
