"""Bad settings and bad data through the launcher: one line that names the problem and the fix, a non-zero exit, no
traceback, and no process started (nothing written). Each case is a launcher process of its own."""

import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from PIL import Image

from tests.conftest import clean_env, free_port, run_script, width

SMALL = ["--dataset=synthetic", "--synthetic_size=1000", *width(8), "--world_size=2", "--batch_size=256"]
DEAD_PROXY = f"http://127.0.0.1:{free_port()}"  # nobody listens: a download fails at once, as offline
OFFLINE = {name: DEAD_PROXY for name in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY")}

CASES = {
    "epochs_zero": (SMALL + ["--epochs=0"], "EPOCHS=0 must be positive"),
    "batch_negative": (SMALL[:-1] + ["--batch_size=-4"], "BATCH_SIZE=-4 must be positive"),
    "batch_not_divisible": (SMALL[:-1] + ["--batch_size=255"], "does not split evenly over 2 ranks"),
    "lr_text": (SMALL + ["--lr=abc"], "--lr=abc is not a number"),
    "lr_negative": (SMALL + ["--lr=-0.1"], "LR=-0.1 must be a positive number"),
    "unknown_dataset": (["--dataset=imagenet21k"], "DATASET='imagenet21k' is unknown"),
    "unknown_setting": (SMALL + ["--no_such_setting=1"], "unknown setting --no_such_setting"),
    "wrong_type": (SMALL + ["--epochs=many"], "--epochs=many is not an integer"),
    "world_negative": (SMALL[:-2] + ["--world_size=-1"], "WORLD_SIZE=-1 is negative"),
    "sync_bn_on_cpu": (SMALL + ["--sync_bn=True"], "SYNC_BN=True needs GPUs"),
    "data_dir_missing": (["--dataset=imagefolder", "--data_dir={tmp}/nope"], "does not exist"),
    "data_dir_empty": (["--dataset=imagefolder", "--data_dir={tmp}/empty"], "has no train/ folder"),
    "data_dir_no_classes": (["--dataset=imagefolder", "--data_dir={tmp}/noclasses"], "holds no class folders"),
    "data_dir_is_a_file": (
        ["--dataset=imagefolder", "--data_dir={tmp}/a_file"],
        "{tmp}/a_file is a file, not a folder",
    ),
    "cifar10_data_dir_is_a_file": (["--dataset=cifar10", "--data_dir={tmp}/a_file"], "{tmp}/a_file is a file; point"),
    "empty_class": (
        ["--dataset=imagefolder", "--data_dir={tmp}/emptyclass"],
        "{tmp}/emptyclass/train/zebra holds no images",
    ),
    "truncated_jpeg": (
        ["--dataset=imagefolder", "--data_dir={tmp}/truncated", "--batch_size=2"],
        "{tmp}/truncated/train/cat/cut.jpg (image file is truncated",
    ),
    "text_as_jpeg": (
        ["--dataset=imagefolder", "--data_dir={tmp}/text", "--batch_size=2"],
        "{tmp}/text/test/dog/notes.jpg (cannot identify image file",
    ),
    "broken_link": (
        ["--dataset=imagefolder", "--data_dir={tmp}/brokenlink"],
        "are links to files that do not exist: {tmp}/brokenlink/train/cat/gone.jpg",
    ),
    "class_mismatch": (
        ["--dataset=imagefolder", "--data_dir={tmp}/mismatch"],
        "only in train/: bird; only in test/: frog",
    ),
    "cifar10_other_size": (["--dataset=cifar10", "--image_size=64"], "CIFAR-10's images are 32x32"),
    "stream_of_generated_images": (SMALL + ["--loader=stream"], "LOADER='stream' reads image folders; DATASET="),
    "output_dir_is_file": (
        SMALL + ["--output_dir={tmp}/a_file"],
        "OUTPUT_DIR {tmp}/a_file cannot be a folder: {tmp}/a_file is a file",
    ),
    "output_dir_under_file": (SMALL + ["--output_dir={tmp}/a_file/out"], "is a file; choose another"),
    "output_dir_empty": (SMALL + ["--output_dir="], "OUTPUT_DIR='' is empty"),
    "resume_nothing": (SMALL + ["--resume=True"], "RESUME=True but there is no"),
    "resume_moved_aside": (
        SMALL + ["--resume=True", "--output_dir={tmp}/moved"],
        "a later run moved the last one to {tmp}/moved/previous-20260101-000000",
    ),
    "cifar10_offline": (["--dataset=cifar10", "--data_dir={tmp}/cifar"], "copy cifar-10-python.tar.gz into"),
    "cifar10_corrupt": (
        ["--dataset=cifar10", "--data_dir={tmp}/corrupt"],
        "{tmp}/corrupt/cifar-10-python.tar.gz is corrupt",
    ),
    "too_many_images_for_memory": (["--dataset=synthetic", "--synthetic_size=1000000000"], "GB of memory ("),
    "master_port_not_a_number": (SMALL + ["--env:MASTER_PORT=abc"], "MASTER_PORT='abc' is not a port number"),
    "master_port_too_large": (SMALL + ["--env:MASTER_PORT=70000"], "MASTER_PORT='70000' is not a port number"),
    "master_port_in_use": (SMALL + ["--env:MASTER_PORT={held_port}"], "MASTER_PORT={held_port} on MASTER_ADDR"),
    "master_addr_unresolvable": (SMALL + ["--env:MASTER_ADDR=nohost.invalid"], "MASTER_ADDR=nohost.invalid does not"),
    "master_addr_of_another_machine": (  # TEST-NET-1: no machine's address
        SMALL + ["--env:MASTER_ADDR=192.0.2.1"],
        "MASTER_ADDR=192.0.2.1 is not an address of this machine",
    ),
}


def picture(path: Path, colour: int, size: int = 32) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (size, size), (colour, 255 - colour, 128)).save(path, quality=90)


def image_folder(root: Path, classes: dict) -> None:
    """classes: {"train/cat": 2, ...} -> that many small JPEGs in each folder."""
    for folder, count in classes.items():
        (root / folder).mkdir(parents=True, exist_ok=True)
        for i in range(count):
            picture(root / folder / f"{i}.jpg", 40 * i)


def make_bad_inputs(tmp: Path) -> None:
    (tmp / "empty").mkdir()
    for split in ("train", "test"):
        (tmp / "noclasses" / split).mkdir(parents=True)
    image_folder(tmp / "emptyclass", {"train/cat": 2, "train/zebra": 0, "test/cat": 2, "test/zebra": 1})
    image_folder(tmp / "truncated", {"train/cat": 2, "test/cat": 2})
    photo = tmp / "truncated" / "train" / "cat" / "cut.jpg"
    Image.effect_noise((64, 64), 60).convert("RGB").save(photo, quality=95)
    photo.write_bytes(photo.read_bytes()[: int(0.8 * photo.stat().st_size)])  # a download cut short
    image_folder(tmp / "text", {"train/dog": 2, "test/dog": 1})
    (tmp / "text" / "test" / "dog" / "notes.jpg").write_text("not a picture")
    image_folder(tmp / "brokenlink", {"train/cat": 2, "test/cat": 1})
    (tmp / "brokenlink" / "train" / "cat" / "gone.jpg").symlink_to(tmp / "deleted.jpg")
    image_folder(tmp / "mismatch", {"train/cat": 1, "train/bird": 1, "test/cat": 1, "test/frog": 1})
    (tmp / "mismatch" / "test" / ".ipynb_checkpoints").mkdir()  # hidden folders are not classes
    (tmp / "a_file").write_text("not a folder")
    (tmp / "moved" / "previous-20260101-000000").mkdir(parents=True)
    (tmp / "moved" / "previous-20260101-000000" / "checkpoint.pt").write_bytes(b"a checkpoint")
    (tmp / "corrupt").mkdir()
    (tmp / "corrupt" / "cifar-10-python.tar.gz").write_bytes(b"half a download")


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    """Every case through a launcher process of its own, four at a time; (result, seconds) by name."""
    tmp = tmp_path_factory.mktemp("bad")
    make_bad_inputs(tmp)
    with socket.socket() as held:  # another program listening on the port a user chose
        held.bind(("127.0.0.1", 0))
        held.listen()
        held_port = str(held.getsockname()[1])

        def outcome(name):
            arguments = [a.replace("{tmp}", str(tmp)).replace("{held_port}", held_port) for a in CASES[name][0]]
            env = {k: v for k, v in clean_env(**OFFLINE).items() if k.lower() != "no_proxy"}
            for a in [a for a in arguments if a.startswith("--env:")]:
                env.update([a[len("--env:") :].split("=", 1)])
                arguments.remove(a)
            if not any(a.startswith("--output_dir") for a in arguments):
                arguments.append(f"--output_dir={tmp / name / 'out'}")
            started = time.monotonic()
            result = run_script(*arguments, timeout=120, env=env)
            return name, (result, time.monotonic() - started)

        with ThreadPoolExecutor(4) as pool:
            results = dict(pool.map(outcome, CASES))
    return {name: (result, seconds, tmp, held_port) for name, (result, seconds) in results.items()}


@pytest.mark.parametrize("name", CASES)
def test_one_line_error(outcomes, name):
    result, seconds, tmp, held_port = outcomes[name]
    assert result.returncode not in (0, None)
    assert "Traceback" not in result.stderr + result.stdout
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert CASES[name][1].replace("{tmp}", str(tmp)).replace("{held_port}", held_port) in lines[0]
    assert result.stdout == ""
    assert not (tmp / name / "out").exists(), "something was written: the run got past the checks"
    assert seconds < 30 if name.startswith("master_") else True  # named at once, not after a wait
