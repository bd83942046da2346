"""The data (data.py), in-process: shards, crops and flips, the memory loader's batches, image folders as users bring
them, decoding, normalisation, generated images, and CIFAR-10's missing-data line. The ranks' side (every rank's data
compared, the stream loader's end-of-pass check) runs in real runs elsewhere."""

import os
import socket
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

import data
from safeguards.failures import UserError
from tests.conftest import call, read_config


def memory_loader(pixels, labels, augment=False, mean=(0.0,) * 3, std=(1 / 255,) * 3) -> data.MemoryLoader:
    """A split held in memory on the CPU, for the channels_last network; the default statistics leave pixel values
    as they are."""
    return data.MemoryLoader((pixels, labels), augment, mean, std, torch.device("cpu"), torch.channels_last)


def folder_config(root, *extra: str):
    return read_config(["--dataset=imagefolder", f"--data_dir={root}", *extra])


def write_png(path, pixels: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels).save(path)


def small_folder(root, classes=("cat", "dog"), images: int = 2, size: int = 8) -> None:
    """`images` PNGs of random pixels per class, in train/ and test/."""
    rng = np.random.default_rng(0)
    for split in ("train", "test"):
        for name in classes:
            for i in range(images):
                write_png(root / split / name / f"{i}.png", rng.integers(0, 256, (size, size, 3), dtype=np.uint8))


def one_line_error(action) -> str:
    with pytest.raises(UserError) as error:
        action()
    assert "\n" not in str(error.value)
    return str(error.value)


# ----------------------------------------------------------------------------- shards


@pytest.mark.parametrize("n, world_size", [(1000, 2), (1001, 2), (997, 4), (50, 1)])
def test_shards_are_disjoint_equal_and_cover_the_epoch(n, world_size):
    shards = [data.shard_indices(n, world_size, rank, seed=3, epoch=1) for rank in range(world_size)]
    assert len({len(s) for s in shards}) == 1, "shards differ in size"
    union = torch.cat(shards)
    assert len(set(union.tolist())) == len(union), "shards overlap"
    assert len(union) == n - n % world_size, "fewer than world_size images may sit out, no more"
    assert set(union.tolist()) <= set(range(n))


def test_every_epoch_has_a_new_order_and_the_left_out_images_change():
    n, world_size = 1001, 2
    first = torch.cat([data.shard_indices(n, world_size, r, 0, epoch=1) for r in range(world_size)])
    second = torch.cat([data.shard_indices(n, world_size, r, 0, epoch=2) for r in range(world_size)])
    again = torch.cat([data.shard_indices(n, world_size, r, 0, epoch=1) for r in range(world_size)])
    assert not torch.equal(first, second) and torch.equal(first, again)
    assert set(range(n)) - set(first.tolist()) != set(range(n)) - set(second.tolist())


def test_all_ranks_together_take_the_global_batch_of_one_process():
    """Step s of all ranks together uses the same images as step s of one process with the same global batch."""
    n, global_batch = 1000, 100
    single = data.shard_indices(n, 1, 0, seed=5, epoch=4)
    for world_size in (2, 4):
        local = global_batch // world_size
        shards = [data.shard_indices(n, world_size, r, seed=5, epoch=4) for r in range(world_size)]
        for step in range(n // global_batch):
            together = torch.cat([s[step * local : (step + 1) * local] for s in shards])
            assert set(together.tolist()) == set(single[step * global_batch : (step + 1) * global_batch].tolist())


def test_shards_are_distributed_samplers_so_that_an_image_folder_trains_alike_in_memory_or_streamed():
    from torch.utils.data.distributed import DistributedSampler

    for n, world_size in ((1000, 2), (1001, 4), (7, 1)):
        for rank in range(world_size):
            sampler = DistributedSampler(range(n), world_size, rank, shuffle=True, seed=3, drop_last=True)
            sampler.set_epoch(2)
            assert data.shard_indices(n, world_size, rank, seed=3, epoch=2).tolist() == list(sampler), (n, rank)


# ----------------------------------------------------------------------------- crops and flips


def coordinates(batch: int, height: int, width: int) -> torch.Tensor:
    """uint8 NHWC images whose channel 0 holds each pixel's row and channel 1 its column."""
    rows = torch.arange(height).view(1, height, 1, 1).expand(batch, height, width, 1)
    cols = torch.arange(width).view(1, 1, width, 1).expand(batch, height, width, 1)
    return torch.cat([rows, cols, torch.zeros_like(rows)], dim=3).to(torch.uint8)


def test_crop_and_flip_moves_whole_rows_and_columns():
    height = width = 32
    out = data.crop_and_flip(coordinates(64, height, width), pad=4, generator=torch.Generator().manual_seed(0))
    assert out.shape == (64, height, width, 3) and out.dtype == torch.uint8
    for image in out.long():
        assert (image[:, :, 0] == image[:, :1, 0]).all()  # each output row is one source row ...
        assert (image[:, :, 1] == image[:1, :, 1]).all()  # ... and each output column one source column
        row_steps, col_steps = image[1:, 0, 0] - image[:-1, 0, 0], image[0, 1:, 1] - image[0, :-1, 1]
        assert set(row_steps.abs().tolist()) <= {0, 1} and set(col_steps.abs().tolist()) <= {0, 1}
        interior = slice(4, height - 4)  # away from the reflected edges the shift is constant, at most the padding
        shift = image[interior, 0, 0] - torch.arange(height)[interior]
        assert (shift == shift[0]).all() and shift[0].abs() <= 4


def test_crop_and_flip_matches_a_flip_then_reflect_padding_then_a_crop():
    """The same draws from the same generator, applied image by image as the textbook does it (a crop of the mirror
    image: the same distribution as a mirror of the crop, since shifts are drawn symmetrically)."""
    pixels = torch.randint(0, 256, (16, 12, 12, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    ours = data.crop_and_flip(pixels, 2, torch.Generator().manual_seed(9))
    g = torch.Generator().manual_seed(9)
    shifts = torch.randint(-2, 3, (2, 16, 1), generator=g)
    flips = torch.rand(16, 1, generator=g) < 0.5
    for i in range(16):
        image = pixels[i].numpy()[:, ::-1] if flips[i] else pixels[i].numpy()
        padded = np.pad(image, ((2, 2), (2, 2), (0, 0)), mode="reflect")
        top, left = 2 + int(shifts[0, i]), 2 + int(shifts[1, i])
        assert np.array_equal(ours[i].numpy(), padded[top : top + 12, left : left + 12]), i
    assert 2 <= int(flips.sum()) <= 14


def test_augmentation_differs_per_rank_and_epoch_and_repeats_per_seed():
    loader = memory_loader(*data.make_synthetic(8, 0, 0), True)
    pixels = coordinates(64, 16, 16)

    def augmented(seed: int, epoch: int, rank: int) -> torch.Tensor:
        return data.crop_and_flip(pixels, 2, loader.augmentation(seed, epoch, rank))

    assert torch.equal(augmented(1, 1, 0), augmented(1, 1, 0))
    for other in ((1, 1, 1), (1, 2, 0), (2, 1, 0)):  # another rank, epoch or seed
        assert not torch.equal(augmented(1, 1, 0), augmented(*other)), other


def mirrored_per_image(loader: data.MemoryLoader, epoch: int, world_size: int) -> dict[int, bool]:
    """For each image the loader gave out in `epoch` (all ranks): whether it came out mirrored. Channel 0 of image i
    holds i, channel 1 its column index, so a mirrored image's columns run backwards."""
    seen = {}
    for rank in range(world_size):
        for x, _ in loader.train_batches(16, world_size, rank, seed=3, epoch=epoch):
            pixels = (x * loader.std + loader.mean).round().long()  # back to the stored values
            for image in pixels:
                seen[int(image[0, 0, 0])] = bool(image[1, 4, 8] < image[1, 4, 7])
    return seen


def test_the_loader_mirrors_about_half_the_images_independently_each_epoch():
    n = 64
    pixels = torch.zeros(n, 16, 16, 3, dtype=torch.uint8)
    pixels[..., 0] = torch.arange(n, dtype=torch.uint8)[:, None, None]
    pixels[..., 1] = torch.arange(16, dtype=torch.uint8)[None, None, :] + 50
    loader = memory_loader(pixels, torch.arange(n) % 10, True, (0.5,) * 3, (0.25,) * 3)
    one, two = mirrored_per_image(loader, 1, 2), mirrored_per_image(loader, 2, 2)
    assert len(one) == len(two) == n and 10 < sum(one.values()) < 54
    assert 10 < sum(one[i] == two[i] for i in range(n)) < 54  # about half keep their side by chance
    plain = memory_loader(pixels, torch.arange(n) % 10, False, (0.5,) * 3, (0.25,) * 3)
    assert not any(mirrored_per_image(plain, 1, 2).values())  # AUGMENT=False: as stored


def test_crops_shift_by_an_eighth_of_the_image():
    for size, pad in ((16, 2), (32, 4), (64, 8)):
        pixels = torch.zeros(128, size, size, 3, dtype=torch.uint8)
        pixels[..., 0] = torch.arange(size, dtype=torch.uint8)[None, :, None]  # the row index
        loader = memory_loader(pixels, torch.zeros(128, dtype=torch.long), True)
        x, _ = next(loader.train_batches(128, 1, 0, seed=0, epoch=1))
        shifts = (x[:, 0, size // 2, 0] - size // 2).round().long()  # the middle row's source row, less its own
        assert shifts.abs().max() == pad and shifts.min() == -pad, size


# ----------------------------------------------------------------------------- the memory loader's batches


@pytest.mark.parametrize("n, world_size", [(1000, 2), (999, 2), (1201, 2), (10, 3)])
def test_evaluation_covers_every_test_image_exactly_once(n, world_size):
    loader = memory_loader(torch.zeros(n, 8, 8, 3, dtype=torch.uint8), torch.arange(n))
    seen = [y for rank in range(world_size) for _, y in loader.eval_batches(world_size, rank)]
    assert sorted(torch.cat(seen).tolist()) == list(range(n))
    assert max(len(y) for y in seen) <= data.EVAL_BATCH


def test_training_batches_are_this_ranks_shard_in_full_batches():
    n, global_batch = 600, 256
    loader = memory_loader(torch.zeros(n, 8, 8, 3, dtype=torch.uint8), torch.arange(n))
    shards = [[y for _, y in loader.train_batches(global_batch, 2, rank, seed=0, epoch=1)] for rank in (0, 1)]
    assert [len(batches) for batches in shards] == [loader.steps_per_epoch(global_batch)] * 2 == [2, 2]
    assert all(len(y) == global_batch // 2 for batches in shards for y in batches)  # the last partial batch dropped
    for rank, batches in enumerate(shards):
        assert torch.equal(torch.cat(batches), data.shard_indices(n, 2, rank, 0, 1)[: 2 * global_batch // 2])


def test_batches_are_normalised_float_in_channels_last():
    pixels, labels = data.make_synthetic(600, seed=0, split=0, image_size=16)
    values = pixels.reshape(-1, 3).double() / 255  # these images' own statistics: normalised to mean 0, std 1
    mean, std = tuple(values.mean(0).tolist()), tuple(values.std(0).tolist())
    loader = memory_loader(pixels, labels, True, mean, std)
    x, y = next(loader.train_batches(256, 2, 1, seed=0, epoch=1))
    assert x.shape == (128, 3, 16, 16) and x.dtype == torch.float32 and y.shape == (128,)
    assert x.is_contiguous(memory_format=torch.channels_last)
    x, _ = next(loader.eval_batches(1, 0))
    mean_, std_ = (torch.tensor(m, dtype=torch.float64).view(1, 3, 1, 1) for m in (mean, std))
    expected = (pixels[: len(x)].permute(0, 3, 1, 2).double() / 255 - mean_) / std_
    assert (x.double() - expected).abs().max() < 1e-5  # (pixel - mean) / std, per channel
    assert x.mean(dim=(0, 2, 3)).abs().max() < 0.05 and (x.std(dim=(0, 2, 3)) - 1).abs().max() < 0.05


# ----------------------------------------------------------------------------- image folders


def test_list_folder_finds_classes_sorted_and_skips_hidden_folders_and_files_and_other_files(tmp_path):
    small_folder(tmp_path, classes=("dog", "ant", "cat"), images=1)
    write_png(tmp_path / "train" / "cat" / "more" / "nested.png", np.zeros((8, 8, 3), np.uint8))
    write_png(tmp_path / "train" / ".ipynb_checkpoints" / "x.png", np.zeros((8, 8, 3), np.uint8))
    write_png(tmp_path / "train" / "cat" / ".thumbnails" / "0.png", np.zeros((8, 8, 3), np.uint8))
    (tmp_path / "train" / "dog" / "._0.png").write_bytes(b"\x00\x05\x16\x07 macOS's resource fork")
    (tmp_path / "train" / "dog" / "notes.txt").write_text("not an image")
    classes, samples = data.list_folder(str(tmp_path), "train")
    assert classes == ["ant", "cat", "dog"]
    listed = [(os.path.relpath(path, tmp_path / "train"), label) for path, label in samples]
    assert sorted(listed) == [("ant/0.png", 0), ("cat/0.png", 1), ("cat/more/nested.png", 1), ("dog/0.png", 2)]


def test_a_folder_lists_the_files_that_torchvisions_image_folder_does_apart_from_hidden_ones(tmp_path):
    """The extensions are torchvision's, written out (no torchvision import for listing): the same files, in the same
    order, with the same labels, as torchvision's ImageFolder finds, for every extension and case."""
    from torchvision.datasets import ImageFolder

    for number, suffix in enumerate("jpg JPEG png ppm bmp pgm tif TIFF webp gif npy txt".split()):
        (tmp_path / "train" / "ab"[number % 2]).mkdir(parents=True, exist_ok=True)
        (tmp_path / "train" / "ab"[number % 2] / f"{number}.{suffix}").write_bytes(b"not decoded by either")
    classes, samples = data.list_folder(str(tmp_path), "train")
    theirs = ImageFolder(str(tmp_path / "train"))  # lists and labels; it opens no image until one is asked for
    assert (classes, samples) == (theirs.classes, theirs.samples) and len(samples) == 9


@pytest.mark.parametrize(
    "layout, split, words",
    [
        (None, "train", ["DATA_DIR {root} does not exist; give a folder with train/<class>/ and test/<class>/"]),
        (
            ["train/cat/0.png"],
            "test",
            [
                "DATA_DIR {root} has no test/ folder; give a folder with train/<class>/",
                "hold out a share of train/ to evaluate on: --holdout 0.1",
            ],
        ),  # fmt: skip
        (["train/.hidden/0.png", "train/file.png"], "train", ["{root}/train holds no class folders; put one sub-fo"]),
        (
            ["train/cat/0.png", "train/zebra/notes.txt"],
            "train",
            ["{root}/train: Found no valid file for the classes zebra", "; every class needs images in"],
        ),  # fmt: skip
    ],
)
def test_an_image_folder_mistake_is_one_line_naming_the_fix(tmp_path, layout, split, words):
    root = tmp_path / "images"
    for name in layout or []:
        if name.endswith(".png"):
            write_png(root / name, np.zeros((8, 8, 3), np.uint8))
        else:
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            (root / name).write_text("x")
    message = one_line_error(lambda: data.list_folder(str(root), split))
    assert all(phrase.format(root=root) in message for phrase in words), message


def test_train_and_test_with_other_classes_are_refused(tmp_path):
    small_folder(tmp_path, images=1)
    write_png(tmp_path / "train" / "emu" / "0.png", np.zeros((8, 8, 3), np.uint8))
    write_png(tmp_path / "test" / "yak" / "0.png", np.zeros((8, 8, 3), np.uint8))
    message = one_line_error(lambda: data.prepare(folder_config(tmp_path)))
    assert message == (
        f"{tmp_path}/train and test/ hold other classes (only in train/: emu; only in test/: yak); give both the "
        "same folders"
    )


@pytest.mark.parametrize("seed", [0, 1])
def test_holdout_takes_its_share_of_each_class_by_seed_alone_from_tensors_and_from_a_folders_list(seed):
    """HOLDOUT's split: round(share x a class's images) of each class, drawn from SEED alone (so the same on every rank
    and at every start), the same images whether the split is tensors or a folder's (path, label) list; the rest
    trains, each image in exactly one of the two."""
    labels = torch.tensor([0] * 50 + [1] * 30 + [2] * 7)[torch.randperm(87, generator=torch.Generator().manual_seed(9))]
    pixels = torch.arange(87)  # each image's number
    cfg = read_config([f"--seed={seed}", "--holdout=0.2"])
    (train, train_labels), (held, held_labels) = data.hold_out((pixels, labels), cfg)
    assert [int((held_labels == c).sum()) for c in range(3)] == [10, 6, 1]
    assert sorted(train.tolist() + held.tolist()) == list(range(87)) and (labels[held] == held_labels).all()
    listed = [(f"img{n}.png", int(label)) for n, label in enumerate(labels)]
    assert data.hold_out(listed, cfg)[1] == [(f"img{n}.png", int(labels[n])) for n in held.tolist()]
    (_, _), (again, _) = data.hold_out((pixels, labels), cfg)
    (_, _), (other, _) = data.hold_out((pixels, labels), read_config([f"--seed={seed + 2}", "--holdout=0.2"]))
    assert again.tolist() == held.tolist() and other.tolist() != held.tolist()
    assert data.hold_out((pixels, labels), read_config(["--holdout=0"])) == ((pixels, labels), None)


def test_held_out_images_are_counted_in_the_datas_identity_with_the_share_and_seed_that_drew_them():
    """A resume checks the data's identity: with HOLDOUT it names the share and the seed, and the counts; a split of
    its own is evaluated as "val", beside the test split."""
    info = SimpleNamespace(device=torch.device("cpu"), local_world_size=1)
    settings = ["--dataset=synthetic", "--synthetic_size=500", "--image_size=8", "--batch_size=8", "--seed=0"]
    train, evaluated, record = data.load(read_config([*settings, "--holdout=0.1"]), info, torch.channels_last)
    assert len(train) + len(evaluated["val"]) == 500 and 40 <= len(evaluated["val"]) <= 60
    assert len(evaluated["test"]) == 100 and list(evaluated) == ["test", "val"]
    assert record["identity"].startswith(f"{len(train)} train, {len(evaluated['val'])} held out, 100 test images of")
    assert record["identity"].endswith("held out: HOLDOUT=0.1 of each class drawn by SEED=0")
    plain = data.load(read_config([*settings, "--holdout=0"]), info, torch.channels_last)
    assert list(plain[1]) == ["test"] and plain[2]["identity"].startswith("500 train, 100 test images of 8x8")


def test_the_folder_identity_changes_with_a_file(tmp_path):
    small_folder(tmp_path, images=2)
    _, samples = data.list_folder(str(tmp_path), "train")
    before = data.folder_digest(str(tmp_path), samples)
    assert data.folder_digest(str(tmp_path), samples) == before
    (tmp_path / "train" / "cat" / "0.png").write_bytes(b"another size")
    assert data.folder_digest(str(tmp_path), samples) != before


# ----------------------------------------------------------------------------- decoding


def test_16_bit_grey_keeps_its_levels(tmp_path):
    levels = np.array([[0, 257 * 100], [65535, 257 * 3]], dtype=np.uint16)  # Pillow's RGB would make them white
    Image.fromarray(levels).save(tmp_path / "grey.png")
    decoded = data.decode(str(tmp_path / "grey.png"), 2)
    assert decoded.shape == (2, 2, 3) and decoded.dtype == np.uint8
    assert (decoded == np.array([[0, 100], [255, 3]], dtype=np.uint8)[..., None]).all()


@pytest.mark.parametrize("suffix", ["png", "gif"])
def test_palette_images_keep_their_colours(tmp_path, suffix):
    picture = Image.new("P", (4, 4))
    picture.putpalette([255, 0, 0, 10, 200, 30] + [0] * 762)
    picture.putdata([0, 0, 1, 1] * 4)
    picture.info["transparency"] = 0  # a transparent colour: Pillow warns that it wants RGBA first
    picture.save(tmp_path / f"palette.{suffix}")
    decoded = data.decode(str(tmp_path / f"palette.{suffix}"), 4)
    assert (decoded[:, :2] == [255, 0, 0]).all() and (decoded[:, 2:] == [10, 200, 30]).all()


def test_images_of_another_size_are_stretched_to_the_square(tmp_path):
    wide = np.zeros((32, 64, 3), np.uint8)
    wide[:, 32:] = 200  # left half dark, right half bright: a stretch keeps the halves, a crop would not
    write_png(tmp_path / "wide.png", wide)
    decoded = data.decode(str(tmp_path / "wide.png"), 16)
    assert decoded.shape == (16, 16, 3)
    assert (decoded[:, :7] == 0).all() and (decoded[:, 9:] == 200).all()
    write_png(tmp_path / "small.png", np.full((8, 8, 3), 90, np.uint8))
    assert (data.decode(str(tmp_path / "small.png"), 16) == 90).all()


def test_an_unreadable_file_is_marked_and_named_instead_of_raising(tmp_path):
    small_folder(tmp_path, images=1)
    (tmp_path / "train" / "cat" / "broken.png").write_bytes(b"not a picture")
    _, samples = data.list_folder(str(tmp_path), "train")
    files = data.ImageFiles(samples, 8)
    broken = [str(path) for path, _ in samples].index(str(tmp_path / "train" / "cat" / "broken.png"))
    pixels, label, mark = files[broken]
    assert mark == broken and pixels.shape == (8, 8, 3) and int(label) == 0 and pixels.sum() == 0
    assert [files[i][2] for i in range(len(files)) if i != broken] == [-1] * (len(files) - 1)
    assert files.unreadable([broken, broken]) == f"1 of 3 images cannot be read: {tmp_path}/train/cat/broken.png"


def test_many_unreadable_files_are_named_three_and_counted(tmp_path):
    for i in range(5):
        (tmp_path / "train" / "cat").mkdir(parents=True, exist_ok=True)
        (tmp_path / "train" / "cat" / f"{i}.png").write_bytes(b"")
    _, samples = data.list_folder(str(tmp_path), "train")
    line = data.ImageFiles(samples, 8).unreadable(list(range(5)))
    assert line.startswith("5 of 5 images cannot be read: ") and line.endswith(" and 2 more")


def test_the_reader_decodes_a_folder_in_order_and_marks_an_unreadable_file(tmp_path):
    small_folder(tmp_path, images=2)
    (tmp_path / "train" / "dog" / "truncated.png").write_bytes((tmp_path / "train" / "dog" / "0.png").read_bytes()[:60])
    _, samples = data.list_folder(str(tmp_path), "train")
    [(pixels, labels, marks)] = list(data.reader(data.ImageFiles(samples, 8), 256, None, 0, pin=False))
    assert pixels.shape == (5, 8, 8, 3) and pixels.dtype == torch.uint8 and labels.tolist() == [0, 0, 1, 1, 1]
    assert marks.tolist() == [-1, -1, -1, -1, 4] and not pixels[4].any()  # black, and named by its index
    assert np.array_equal(pixels[0].numpy(), np.asarray(Image.open(tmp_path / "train" / "cat" / "0.png")))


def decode_a_folder(root: str) -> int:
    """Every training image of the folder, decoded as a run decodes them (tests.conftest.call)."""
    _, samples = data.list_folder(root, "train")
    list(data.reader(data.ImageFiles(samples, 8), 256, None, 0, pin=False))
    return 0


def test_decoding_images_prints_no_warning(tmp_path):
    """In a process of its own: torch warns once per process, and every decoding worker of a run is one."""
    small_folder(tmp_path, images=2)
    result = call("tests.test_data:decode_a_folder", str(tmp_path), timeout=60)
    assert result.returncode == 0 and result.stderr == "", result.stderr


# ----------------------------------------------------------------------------- normalisation and generated images


def test_synthetic_classes_are_learnable_by_their_colour():
    """A nearest-class-mean classifier on the mean colour already beats chance (0.1) by far."""
    (train, train_labels), (test, test_labels) = data.make_synthetic(2000, 0, 0), data.make_synthetic(400, 0, 1)
    assert train.shape == (2000, 32, 32, 3) and train.dtype == torch.uint8
    colour = lambda images: images.float().mean(dim=(1, 2))  # noqa: E731
    centres = torch.stack([colour(train)[train_labels == c].mean(0) for c in range(data.SYNTHETIC_CLASSES)])
    predicted = torch.cdist(colour(test), centres).argmin(1)
    assert (predicted == test_labels).float().mean() > 0.3
    assert not torch.equal(train[:400], test)  # the test split is other images
    assert torch.equal(data.make_synthetic(50, 0, 0)[0], data.make_synthetic(50, 0, 0)[0])  # the same seed: the same


# ----------------------------------------------------------------------------- CIFAR-10


def test_cifar10_that_cannot_be_downloaded_is_one_line_naming_the_archive(tmp_path, monkeypatch):
    from torchvision.datasets import CIFAR10

    with socket.socket() as s:  # a port nobody listens on: the download fails at once, online or not
        s.bind(("127.0.0.1", 0))
        monkeypatch.setattr(CIFAR10, "url", f"http://127.0.0.1:{s.getsockname()[1]}/cifar-10-python.tar.gz")
    cfg = read_config(["--dataset=cifar10", f"--data_dir={tmp_path}"])
    message = one_line_error(lambda: data.prepare(cfg))
    assert message.startswith(f"could not download CIFAR-10 into {tmp_path} (")
    assert f"copy cifar-10-python.tar.gz into {tmp_path}/ by hand and rerun, or use --dataset imagefolder" in message


def test_cifar10_missing_where_a_rank_reads_it_is_one_line(tmp_path):
    message = one_line_error(lambda: data._cifar10(str(tmp_path), train=True))
    assert message == f"CIFAR-10 is missing or corrupt in {tmp_path}; delete it there and rerun"
