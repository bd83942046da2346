import os
import pickle
import shutil
import socket
from concurrent.futures import ThreadPoolExecutor

import image_folder
import pytest
import torch
from loaders import DeviceLoader, crop_and_flip, shard_indices
from PIL import Image
from processes import UserError
from torchvision.datasets import CIFAR10

import data
from data import ImageSet
from tests.conftest import read_config


def cached_image_folder(root: str, size: int) -> ImageSet:
    return ImageSet(**image_folder.decoded(root, size))


def folder_config(root, *extra: str):
    return read_config(["--dataset=imagefolder", f"--data_dir={root}", *extra])


# ----------------------------------------------------------------------------- shards


@pytest.mark.parametrize("n,world_size", [(1000, 2), (1001, 2), (997, 4), (50, 1)])
def test_shards_are_disjoint_equal_and_cover_the_epoch(n, world_size):
    shards = [shard_indices(n, world_size, rank, seed=3, epoch=1) for rank in range(world_size)]
    assert len({len(s) for s in shards}) == 1, "shards differ in size"
    union = torch.cat(shards)
    assert len(set(union.tolist())) == len(union), "shards overlap"
    assert len(union) == n - n % world_size, "fewer than world_size images may sit out, no more"


def test_every_epoch_has_a_new_order_and_the_left_out_images_change():
    n, ws = 1001, 2
    first = torch.cat([shard_indices(n, ws, r, 0, epoch=1) for r in range(ws)])
    second = torch.cat([shard_indices(n, ws, r, 0, epoch=2) for r in range(ws)])
    assert not torch.equal(first, second)
    assert set(range(n)) - set(first.tolist()) != set(range(n)) - set(second.tolist())


def test_all_ranks_draw_the_same_permutation():
    """Rank r's shard is every ws-th entry of one shared permutation: step s of all ranks together uses
    the same images as step s of a single process with the same global batch."""
    n, global_batch = 1000, 100
    single = shard_indices(n, 1, 0, seed=5, epoch=4)
    for ws in (2, 4):
        local = global_batch // ws
        shards = [shard_indices(n, ws, r, seed=5, epoch=4) for r in range(ws)]
        for step in range(n // global_batch):
            together = torch.cat([s[step * local : (step + 1) * local] for s in shards])
            assert set(together.tolist()) == set(single[step * global_batch : (step + 1) * global_batch].tolist())


# ----------------------------------------------------------------------------- augmentation


def test_crop_and_flip_moves_whole_columns_and_rows():
    """A pixel's value encodes where it came from: every output row must be a contiguous (or mirrored)
    run of source columns and rows shift by at most the padding, reflected at the edges."""
    height = width = 32
    rows = torch.arange(height).view(1, height, 1, 1).expand(64, height, width, 1)
    cols = torch.arange(width).view(1, 1, width, 1).expand(64, height, width, 1)
    pixels = torch.cat([rows, cols, torch.zeros_like(rows)], dim=3).to(torch.uint8)
    out = crop_and_flip(pixels, pad=4, generator=torch.Generator().manual_seed(0))
    assert out.shape == pixels.shape and out.dtype == torch.uint8
    flipped = 0
    for image in out.long():
        col_steps = image[0, 1:, 1] - image[0, :-1, 1]
        row_shift = image[:, 0, 0] - torch.arange(height)
        assert ((col_steps.abs() == 1) | (col_steps == 0)).all()
        interior = slice(4, height - 4)  # away from the reflected edges the shift is constant
        assert (row_shift[interior] == row_shift[interior][0]).all() and row_shift.abs().max() <= 8
        flipped += int(image[0, width // 2 + 1, 1] < image[0, width // 2 - 1, 1])
    assert 10 < flipped < 54, f"{flipped} of 64 images flipped"


def test_augmentation_differs_per_rank_and_repeats_per_seed():
    images = data.make_synthetic(64, seed=0, split=0)
    loader = DeviceLoader(images, torch.device("cpu"), augment=True)
    batch = lambda rank, seed: next(loader.train_batches(32, 2, rank, seed, epoch=1))[0]  # noqa: E731
    assert torch.equal(batch(0, 1), batch(0, 1))
    plain = DeviceLoader(images, torch.device("cpu"), augment=False)
    assert not torch.equal(batch(0, 1), next(plain.train_batches(32, 2, 0, 1, epoch=1))[0])
    # the same images on both ranks with their own augmentation: compare rank 1 of seed 1 with a re-seeded draw
    assert not torch.equal(batch(1, 1), batch(1, 2))


@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last])
def test_batches_are_normalised_float_in_the_models_memory_format(memory_format):
    images = data.make_synthetic(600, seed=0, split=0)
    loader = DeviceLoader(images, torch.device("cpu"), augment=True, memory_format=memory_format)
    batches = list(loader.train_batches(256, 2, 1, seed=0, epoch=1))
    assert len(batches) == loader.steps_per_epoch(256) == 2  # the last partial batch is dropped
    x, y = batches[0]
    assert x.shape == (128, 3, 32, 32) and x.dtype == torch.float32 and y.shape == (128,)
    assert x.is_contiguous(memory_format=memory_format)
    assert -0.5 < x.mean().item() < 0.5 and 0.5 < x.std().item() < 1.5


@pytest.mark.parametrize("n,world_size", [(1000, 2), (999, 2), (10, 3)])
def test_evaluation_covers_every_test_image_exactly_once(n, world_size):
    images = ImageSet(torch.zeros(n, 3, 32, 32, dtype=torch.uint8), torch.arange(n), ["x"])
    loader = DeviceLoader(images, torch.device("cpu"))
    seen = torch.cat([y for rank in range(world_size) for _, y in loader.eval_batches(world_size, rank, batch_size=64)])
    assert sorted(seen.tolist()) == list(range(n))


# ----------------------------------------------------------------------------- readers on real file formats


def write_png(path, array):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(array.numpy()).save(path)


def test_image_folder_reader(tmp_path):
    pictures = torch.randint(0, 256, (4, 32, 32, 3), dtype=torch.uint8)
    write_png(tmp_path / "train" / "dog" / "a.png", pictures[0])
    write_png(tmp_path / "train" / "cat" / "b.png", pictures[1])
    write_png(tmp_path / "train" / "cat" / "c.png", pictures[2])
    big = torch.full((48, 40, 3), 200, dtype=torch.uint8)
    (tmp_path / "test" / "dog").mkdir(parents=True)
    Image.fromarray(big.numpy()).save(tmp_path / "test" / "dog" / "d.jpg", quality=95)
    write_png(tmp_path / "test" / "cat" / "e.png", pictures[3])
    cfg = folder_config(tmp_path)
    assert data.sizes(cfg) == (3, 2, 2)
    data.prepare(cfg)
    train, test = data.read(cfg)
    assert train.classes == ["cat", "dog"] == test.classes
    assert train.labels.tolist() == [0, 0, 1]  # cat/b, cat/c, dog/a
    assert torch.equal(train.images[2], pictures[0].permute(2, 0, 1))
    assert test.images.shape == (2, 3, 32, 32) and test.images.dtype == torch.uint8
    assert (test.images[1].int() - 200).abs().max() <= 3  # the 48x40 JPEG, resized to 32x32


@pytest.mark.parametrize(
    "layout,message", [(None, "does not exist"), ([], "no train/"), (["train", "test"], "zebra holds no images")]
)
def test_image_folder_checks(tmp_path, layout, message):
    root = tmp_path / "images"
    if layout is not None:
        root.mkdir()
        for split in layout:
            (root / split / "zebra").mkdir(parents=True)
    with pytest.raises(UserError, match=message):
        data.prepare(folder_config(root))


def small_folder(root, images: int = 3):
    pictures = torch.randint(0, 256, (images, 32, 32, 3), dtype=torch.uint8)
    for i in range(images):
        write_png(root / "train" / ("cat" if i % 2 else "dog") / f"{i}.png", pictures[i])
        write_png(root / "test" / ("cat" if i % 2 else "dog") / f"{i}.png", pictures[i])


def count_decodes(monkeypatch) -> list:
    calls = []
    original = image_folder.decode_images
    monkeypatch.setattr(
        image_folder, "decode_images", lambda paths, root, size: (calls.append(root), original(paths, root, size))[1]
    )
    return calls


def test_an_image_folder_is_decoded_once_and_reused_until_a_file_changes(tmp_path, monkeypatch):
    small_folder(tmp_path)
    calls = count_decodes(monkeypatch)
    first = cached_image_folder(str(tmp_path / "train"), 32)
    again = cached_image_folder(str(tmp_path / "train"), 32)
    assert (
        len(calls) == 1 and torch.equal(first.images, again.images) and first.labels.tolist() == [0, 1, 1]
    )  # cat/1, dog/0, dog/2
    assert [p.name for p in (tmp_path / ".decoded").glob("train-*.pt")]  # beside the data
    write_png(tmp_path / "train" / "dog" / "0.png", torch.zeros(32, 32, 3, dtype=torch.uint8))  # one file changes
    changed = cached_image_folder(str(tmp_path / "train"), 32)
    assert len(calls) == 2 and changed.images[1].sum() == 0
    assert len(list((tmp_path / ".decoded").glob("train-*.pt"))) == 1  # the outdated cache is gone


def test_machines_ranks_decode_a_folder_once_between_them(tmp_path, monkeypatch):
    small_folder(tmp_path, images=20)
    calls = count_decodes(monkeypatch)
    with ThreadPoolExecutor(3) as pool:  # a lock per folder: one decodes, the others wait and load
        sets = list(pool.map(lambda _: cached_image_folder(str(tmp_path / "train"), 32), range(3)))
    assert len(calls) == 1 and all(torch.equal(s.images, sets[0].images) for s in sets)


def test_a_read_only_data_dir_caches_in_the_users_cache_folder(tmp_path, monkeypatch):
    small_folder(tmp_path / "data")
    (tmp_path / "data" / ".decoded").write_text("in the way, as a read-only DATA_DIR would be")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    cached_image_folder(str(tmp_path / "data" / "train"), 32)
    assert list((tmp_path / "cache" / "resnet-ddp").glob("*/train-*.pt"))


def write_cifar_batch(path, images, labels):
    """CIFAR-10's python format: a pickled dict, images as rows of 3072 bytes (R, G, B planes)."""
    with open(path, "wb") as f:
        pickle.dump({"data": images.reshape(len(images), -1).numpy(), "labels": labels}, f, protocol=2)


def test_cifar10_reader(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    images = torch.randint(0, 256, (6, 12, 3, 32, 32), dtype=torch.uint8)
    for i in range(5):
        write_cifar_batch(folder / f"data_batch_{i + 1}", images[i], list(range(i, i + 12)))
    write_cifar_batch(folder / "test_batch", images[5], [9] * 12)
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump(
            {"label_names": ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]},
            f,
            protocol=2,
        )
    train, test = data.read(read_config(["--dataset=cifar10", f"--data_dir={tmp_path}"]))
    assert torch.equal(train.images, images[:5].reshape(60, 3, 32, 32))
    assert train.labels.tolist() == [label for i in range(5) for label in range(i, i + 12)]
    assert torch.equal(test.images, images[5]) and test.labels.tolist() == [9] * 12
    assert train.classes[0] == "airplane" and len(train.classes) == 10


def test_cifar10_missing_files_name_the_archive(tmp_path):
    with pytest.raises(UserError, match="cifar-10-python.tar.gz"):
        data.read_cifar10(str(tmp_path), train=True)


def test_cifar10_download_failure_is_one_clear_line(tmp_path, monkeypatch):
    with socket.socket() as s:  # a port nobody listens on: the download fails at once, online or not
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}/cifar-10-python.tar.gz"
    monkeypatch.setattr(CIFAR10, "url", dead)
    with pytest.raises(UserError) as error:
        data.download_cifar10(str(tmp_path), timeout_s=5)
    assert "\n" not in str(error.value) and f"into {tmp_path}/" in str(error.value)


def test_synthetic_classes_are_learnable_by_their_colour():
    """A nearest-class-mean classifier on the mean colour already beats chance by far."""
    train, test = data.make_synthetic(2000, 0, split=0), data.make_synthetic(400, 0, split=1)
    colour = lambda s: s.images.float().mean(dim=(2, 3))  # noqa: E731
    centres = torch.stack([colour(train)[train.labels == c].mean(0) for c in range(10)])
    predicted = torch.cdist(colour(test), centres).argmin(1)
    assert (predicted == test.labels).float().mean() > 0.3
    assert not torch.equal(train.images[:400], test.images)


def test_decoding_in_chunks_on_all_cores_names_every_damaged_file(tmp_path, monkeypatch):
    small_folder(tmp_path, images=7)
    (tmp_path / "train" / "cat" / "broken.png").write_bytes(b"not a picture")
    monkeypatch.setattr(image_folder, "DECODE_CHUNK", 2)  # several chunks: decoded by a pool of processes
    with pytest.raises(UserError, match=r"1 of 8 images in .*train cannot be read: .*broken\.png \(cannot identify"):
        cached_image_folder(str(tmp_path / "train"), 32)
    (tmp_path / "train" / "cat" / "broken.png").unlink()
    chunked = cached_image_folder(str(tmp_path / "train"), 32)
    monkeypatch.setattr(image_folder, "DECODE_CHUNK", 2_000)
    shutil.rmtree(tmp_path / ".decoded")
    assert torch.equal(chunked.images, cached_image_folder(str(tmp_path / "train"), 32).images)


# ----------------------------------------------------------------------------- own data as users bring it


def test_images_of_another_size_are_stretched_to_the_square_and_counted(tmp_path):
    write_png(tmp_path / "train" / "cat" / "wide.png", torch.full((40, 80, 3), 90, dtype=torch.uint8))
    write_png(tmp_path / "train" / "cat" / "exact.png", torch.full((64, 64, 3), 10, dtype=torch.uint8))
    write_png(tmp_path / "test" / "cat" / "small.png", torch.full((16, 16, 3), 200, dtype=torch.uint8))
    cfg = folder_config(tmp_path, "--image_size=64")
    data.prepare(cfg)
    train, test = data.read(cfg)
    assert train.images.shape == (2, 3, 64, 64) and test.images.shape == (1, 3, 64, 64)
    assert train.resized == 1 and test.resized == 1  # the 80x40 and the 16x16 images, not the 64x64 one
    assert (train.images[1].int() - 90).abs().max() <= 1 and (test.images[0].int() - 200).abs().max() <= 1
    assert data.record(train, test)["resized"] == 2


def test_an_image_folder_is_normalised_with_its_own_statistics_and_cifar10_with_the_published_ones(tmp_path):
    pictures = torch.randint(100, 160, (6, 32, 32, 3), dtype=torch.uint8)
    for i in range(6):
        write_png(tmp_path / "train" / f"c{i % 2}" / f"{i}.png", pictures[i])
        write_png(tmp_path / "test" / f"c{i % 2}" / f"{i}.png", pictures[i])
    data.prepare(folder_config(tmp_path))
    train, test = data.read(folder_config(tmp_path))
    pixels = train.images.double() / 255
    torch.testing.assert_close(torch.tensor(train.mean), pixels.mean(dim=(0, 2, 3)).float(), rtol=0, atol=1e-6)
    torch.testing.assert_close(
        torch.tensor(train.std), pixels.std(dim=(0, 2, 3), correction=0).float(), atol=1e-6, rtol=0
    )
    assert test.mean == train.mean and test.std == train.std  # the test set is normalised as the training set is
    x, _ = next(DeviceLoader(train, torch.device("cpu")).eval_batches(1, 0))
    assert x.mean(dim=(0, 2, 3)).abs().max() < 1e-4 and (x.std(dim=(0, 2, 3)) - 1).abs().max() < 0.05
    assert data.ImageSet(train.images, train.labels, ["c0", "c1"]).mean == data.CIFAR_MEAN  # CIFAR-10's default


def test_crops_shift_by_an_eighth_of_the_image():
    for size, pad in ((32, 4), (64, 8), (16, 2)):
        images = data.make_synthetic(8, seed=0, split=0, image_size=size)
        assert images.images.shape[-1] == size and DeviceLoader(images, torch.device("cpu")).crop_pad == pad


def test_cifar10_refuses_another_image_size():
    with pytest.raises(UserError, match="IMAGE_SIZE=64 but CIFAR-10's images are 32x32; use --image_size 32"):
        data.sizes(read_config(["--dataset=cifar10", "--image_size=64"]))


def test_a_broken_link_in_an_image_folder_is_named(tmp_path):
    small_folder(tmp_path)
    (tmp_path / "train" / "cat" / "gone.png").symlink_to(tmp_path / "nowhere.png")
    with pytest.raises(UserError, match=r"1 file\(s\) in .*train are links to files that do not exist: .*gone\.png"):
        data.prepare(folder_config(tmp_path))


@pytest.mark.parametrize(
    "dataset,message", [("imagefolder", "is a file, not a folder"), ("cifar10", "is a file; point")]
)
def test_a_data_dir_that_is_a_file_is_named_as_a_file(tmp_path, dataset, message):
    (tmp_path / "data").write_text("not a folder")
    with pytest.raises(UserError, match=f"DATA_DIR {tmp_path}/data {message}"):
        cfg = read_config([f"--dataset={dataset}", f"--data_dir={tmp_path / 'data'}"])
        data.sizes(cfg)
        data.prepare(cfg)


@pytest.mark.parametrize("size", [32, 30, 33])  # 30 and 33: images whose bytes do not fill whole int64 words
def test_the_identity_tells_other_images_of_the_same_count_apart(size):
    a, b = (data.make_synthetic(50, seed=seed, split=0, image_size=size) for seed in (0, 1))
    test = data.make_synthetic(10, seed=0, split=1, image_size=size)
    identity = lambda train: data.record(train, test)["identity"]  # noqa: E731
    assert identity(a) == identity(a) != identity(b)
    assert identity(a).startswith(f"50 train and 10 test images of {size}x{size}, checksum ")


@pytest.mark.parametrize(
    "extra,network,names",
    [
        ([], lambda classes: torch.nn.Linear(10**6, 10**6), "network's size"),
        (["--synthetic_size=1000000000"], None, "number of images"),
    ],
)
def test_sizes_that_cannot_fit_in_memory_are_refused_before_anything_starts(extra, network, names):
    import train_distribute as td

    cfg = read_config(["--dataset=synthetic", *extra])
    with pytest.raises(UserError) as error:
        data.check_sizes(cfg, network or (lambda classes: td.make_model(cfg, classes)), ranks=2)
    message = str(error.value)
    assert message.startswith("this run needs about ") and "GB of memory" in message and names in message
    assert f"machine's {os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:,.0f} GB" in message


class ComputesInItsConstructor(torch.nn.Module):
    """As timm's models do: a value read from a tensor while the network is built, which the meta device refuses."""

    def __init__(self, classes: int) -> None:
        super().__init__()
        self.head = torch.nn.Linear(int(torch.linspace(0, 8, 9)[-1].item()), classes)


def test_the_memory_check_counts_a_network_that_cannot_be_built_on_the_meta_device():
    assert data.count_parameters(ComputesInItsConstructor, 10) == 8 * 10 + 10


def test_a_network_that_cannot_be_built_is_one_line_naming_where():
    def make_model(classes: int) -> torch.nn.Module:
        raise OSError("<urlopen error [Errno -3] Temporary failure in name resolution>")  # pretrained, offline

    with pytest.raises(UserError) as error:
        data.count_parameters(make_model, 10)
    assert str(error.value).startswith("make_model cannot build the network (OSError: <urlopen error")
    assert "at test_data.py:" in str(error.value) and "\n" not in str(error.value)


# ----------------------------------------------------------------------------- crops and flips


def mirrored_per_image(loader: DeviceLoader, epoch: int, world_size: int) -> dict[int, bool]:
    """For each image the loader gave out in `epoch` (all ranks): whether it came out mirrored. Channel 0 of
    image i holds i, channel 1 its column index, so a mirrored image's columns run backwards."""
    seen = {}
    for rank in range(world_size):
        for x, _ in loader.train_batches(16, world_size, rank, seed=3, epoch=epoch):
            pixels = x * loader.std + loader.mean  # back to the stored values
            for image in pixels.round().long():
                seen[int(image[0, 0, 0])] = bool(image[1, 4, 8] < image[1, 4, 7])
    return seen


def test_the_loader_mirrors_about_half_the_images_independently_each_epoch():
    n = 64
    images = torch.zeros(n, 3, 16, 16, dtype=torch.uint8)
    images[:, 0] = torch.arange(n, dtype=torch.uint8)[:, None, None]
    images[:, 1] = torch.arange(16, dtype=torch.uint8)[None, None, :] + 50
    labels = torch.arange(n) % 10
    at_random = DeviceLoader(ImageSet(images, labels, ["x"]), torch.device("cpu"), True)
    one, two = mirrored_per_image(at_random, 1, 2), mirrored_per_image(at_random, 2, 2)
    assert len(one) == len(two) == n and 10 < sum(one.values()) < 54
    assert 10 < sum(one[i] == two[i] for i in range(n)) < 54  # about half repeat their side by chance


def test_crops_and_flips_match_an_independent_implementation():
    """The same draws from the same generator, applied image by image with Python lists."""
    pixels = torch.randint(0, 256, (8, 12, 12, 3), dtype=torch.uint8)
    ours = crop_and_flip(pixels, 2, torch.Generator().manual_seed(9))
    g = torch.Generator().manual_seed(9)
    shifts = torch.randint(-2, 3, (2, 8, 1), generator=g)
    flips = torch.rand(8, 1, generator=g) < 0.5
    for i in range(8):
        rows = [abs(r) if abs(r) <= 11 else 22 - abs(r) for r in (torch.arange(12) + shifts[0, i]).tolist()]
        cols = [abs(c) if abs(c) <= 11 else 22 - abs(c) for c in (torch.arange(12) + shifts[1, i]).tolist()]
        cols = [11 - c for c in cols] if flips[i] else cols  # the shifted crop, taken from the mirror image
        assert torch.equal(ours[i], pixels[i][rows][:, cols])
