"""Bad settings through the real command line: one line that names the problem and the fix, a non-zero
exit, no traceback, and no process started (nothing written)."""
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.conftest import clean_env, free_port, run_script

SMALL = ["--dataset=synthetic", "--synthetic_size=1000", "--width=8", "--world_size=2", "--batch_size=256"]
DEAD_PROXY = f"http://127.0.0.1:{free_port()}"  # nobody listens: a download fails at once, as offline

CASES = {
    "epochs_zero": (SMALL + ["--epochs=0"], "EPOCHS=0 must be positive"),
    "batch_negative": (SMALL[:-1] + ["--batch_size=-4"], "BATCH_SIZE=-4 must be positive"),
    "batch_not_divisible": (SMALL[:-1] + ["--batch_size=255"], "does not split evenly over 2 ranks"),
    "lr_text": (SMALL + ["--lr=abc"], "--lr=abc is not a number"),
    "lr_negative": (SMALL + ["--lr=-0.1"], "LR=-0.1 must be a positive number"),
    "unknown_dataset": (["--dataset=imagenet21k"], "DATASET='imagenet21k' is unknown"),
    "unknown_setting": (SMALL + ["--no_such_setting=1"], "unknown setting --no_such_setting"),
    "wrong_type": (SMALL + ["--epochs=many"], "--epochs=many is not an integer"),
    "width_zero": (SMALL + ["--width=0"], "WIDTH=0 must be positive"),
    "world_negative": (SMALL[:-2] + ["--world_size=-1"], "WORLD_SIZE=-1 is negative"),
    "data_dir_missing": (["--dataset=imagefolder", "--data_dir={tmp}/nope"], "does not exist"),
    "data_dir_empty": (["--dataset=imagefolder", "--data_dir={tmp}/empty"], "has no train/ folder"),
    "data_dir_no_images": (["--dataset=imagefolder", "--data_dir={tmp}/classes"], "holds no images"),
    "resume_nothing": (SMALL + ["--resume=True"], "RESUME=True but there is no"),
    "cifar10_offline": (["--dataset=cifar10", "--data_dir={tmp}/cifar"], "copy cifar-10-python.tar.gz into"),
}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bad")
    (tmp / "empty").mkdir()
    for split in ("train", "test"):
        (tmp / "classes" / split / "cat").mkdir(parents=True)
    env = clean_env(**{name: DEAD_PROXY for name in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY")})
    env.pop("no_proxy", None), env.pop("NO_PROXY", None)

    def attempt(name):
        args = [a.replace("{tmp}", str(tmp)) for a in CASES[name][0]]
        return name, run_script(*args, f"--output_dir={tmp / name / 'out'}", timeout=120, env=env), tmp

    with ThreadPoolExecutor(2) as pool:
        return dict((name, (result, tmp)) for name, result, tmp in pool.map(attempt, CASES))


@pytest.mark.parametrize("name", CASES)
def test_one_line_error(outcomes, name):
    result, tmp = outcomes[name]
    assert result.returncode not in (0, None)
    assert "Traceback" not in result.stderr + result.stdout
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert CASES[name][1] in lines[0]
    assert result.stdout == ""
    assert not (tmp / name / "out").exists(), "something was written: the run got past the checks"
