"""README's SLURM batch script on a real two-node cluster (tests/slurm_cluster.py): training on both nodes, the stop
and requeue at the time limit, scancel, and a requeue of a finished job. Skipped without SLURM (not under CI=true).

Nothing here depends on how fast the machine is. SLURM looks at time limits every 30 s and sends the script's signal
when at most the signal's offset plus those 30 s are left, so a fixed short limit stops a run at a random point (in
start-up, say, or never, when the run is fast). Instead the job starts with a long limit; once its first epoch is in
the CSV the test shortens the limit to end 90 to 150 s from then, so that SLURM's next look (within 30 s) sends the
signal while the run trains, whatever its speed, with over a minute left. The run is long enough for that: its epoch
count comes from the epochs that the scancel job measured on the same cluster (and should the machine speed up so much
that the run ends first, a longer one by its own measure runs instead)."""

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import pytest
import torch

from safeguards import files
from tests import slurm_cluster
from tests.conftest import model_name, snapshot, width

pytestmark = pytest.mark.slurm

SETTINGS = ["--dataset=synthetic", "--synthetic_size=3000", *width(8), "--batch_size=64"]
LONG_LIMIT = "10"  # minutes: no signal comes before the test shortens the limit
OFFSET = int(re.search(r"--signal=B:USR1@(\d+)", slurm_cluster.readme_script()).group(1))  # seconds, README's
MORE_TRAINING = 90  # seconds of epochs after the first, when the limit is shortened: SLURM's next look is within 30
BROKEN = ("Killed", "Terminated", "exit code 137", "DUE TO TIME LIMIT")  # a task that did not stop by itself
EPOCH_LINE = re.compile(r"^epoch +(\d+)/(\d+) ", re.MULTILINE)
KEPT = re.escape(
    "continue with the same command on every node and --resume True (torchrun's restarts and a SLURM requeue do so "
    "by themselves)"
)
EVENTS = {
    "epoch": EPOCH_LINE.pattern,
    "stopped": rf"^stopped by SIGTERM: the files in runs/\d+ are from epoch (\d+); {KEPT}$",
    "resumed": r"^resuming after epoch (\d+) of \d+$",
    "finished": r"^already finished: all (\d+) epochs are in runs/\d+; nothing to do$",
}


@dataclass
class Job:
    id: int
    folder: Path  # where it was submitted: its output, and runs/<id>/
    epochs: int
    info: dict[str, str]  # scontrol's view once it ended
    output: str  # its output file then (a later requeue appends to it)
    writer_ranks: set[str]  # the RANK of each process seen holding the OUTPUT_DIR lock
    at_requeue: tuple | None = None  # (checkpoint epoch, CSV epochs, temporary files) when the job was requeued

    @property
    def runs(self) -> Path:
        return self.folder / "runs" / str(self.id)


@pytest.fixture(scope="module")
def cluster():
    reason = slurm_cluster.missing()
    if reason:
        (pytest.fail if os.environ.get("CI") == "true" else pytest.skip)(reason)
    cluster = slurm_cluster.Cluster()
    try:
        yield cluster.start()
    finally:
        cluster.stop()


def run_job(cluster, folder: Path, epochs: int, while_running=lambda job: None) -> Job:
    """README's script with SETTINGS and `epochs`, submitted from `folder` with the long limit and followed until it
    ends, with `while_running(job)` at every look; notes the rank of any process that holds the OUTPUT_DIR lock."""
    job_id = cluster.submit(slurm_cluster.batch_script(LONG_LIMIT, [*SETTINGS, f"--epochs={epochs}"]), folder)
    writers: set[str] = set()

    def ended(job: dict[str, str]) -> bool:
        writers.update(lock_holder_ranks(folder / "runs" / str(job_id)))
        while_running(job)
        return job["JobState"] in slurm_cluster.DONE

    info = cluster.wait(job_id, 600, ended)
    return Job(job_id, folder, epochs, info, output_of(folder, job_id), writers)


def output_of(folder: Path, job_id: int) -> str:
    path = folder / f"slurm-{job_id}.out"
    return path.read_text(errors="replace") if path.exists() else ""


def lock_holder_ranks(runs: Path) -> set[str]:
    """{RANK of the process that holds runs/.lock} (the kernel's list of locks), or {} while none does."""
    try:
        stat = (runs / ".lock").stat()
        where = f"{os.major(stat.st_dev):02x}:{os.minor(stat.st_dev):02x}:{stat.st_ino}"
        pids = [line.split()[4] for line in Path("/proc/locks").read_text().splitlines() if where in line.split()]
        ranks = set()
        for pid in pids:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            ranks |= {value.decode() for key, _, value in (item.partition(b"=") for item in environ) if key == b"RANK"}
        return ranks
    except (OSError, IndexError):  # no lock file yet, or its holder just ended
        return set()


def csv_epochs(runs: Path) -> list[int]:
    path = runs / files.CSV_NAME
    return pd.read_csv(path)["epoch"].tolist() if path.exists() else []


def checkpoint_epoch(runs: Path) -> int:
    return int(torch.load(runs / files.CHECKPOINT_NAME, weights_only=True)["epoch"])


def events(output: str) -> list[tuple[str, int]]:
    """("epoch", n), ("stopped", the epoch kept) and ("resumed", the epoch continued from), in the order printed."""
    found = [
        (match.start(), kind, int(match.group(1)))
        for kind, pattern in EVENTS.items()
        for match in re.finditer(pattern, output, re.MULTILINE)
    ]
    return [(kind, epoch) for _, kind, epoch in sorted(found)]


def assert_no_task_killed(output: str) -> None:
    broken = [line for line in output.splitlines() if any(text in line for text in BROKEN)]
    assert not broken, "\n".join(broken)


def assert_stop_kept_the_last_epoch(seen: list[tuple[str, int]], stop: int) -> int:
    """The epoch a stop says it kept: the last one printed before it, or the one after it (a signal that lands after
    rank 0 handed an epoch's files to its writer and before it printed the epoch's line)."""
    printed = [epoch for kind, epoch in seen[:stop] if kind == "epoch"]
    kept = seen[stop][1]
    assert printed and kept in (printed[-1], printed[-1] + 1), seen
    return kept


def seconds(text: str) -> int:
    """scontrol's [days-]hours:minutes:seconds."""
    days, _, clock = text.rpartition("-")
    hours, minutes, secs = (int(part) for part in clock.split(":"))
    return ((int(days or 0) * 24 + hours) * 60 + minutes) * 60 + secs


# ----------------------------------------------------------------------------- the jobs


@pytest.fixture(scope="module")
def scancel_job(cluster, tmp_path_factory) -> Job:
    """A job cancelled with scancel once rank 0 printed its second epoch (the epochs it ran measure the cluster)."""
    folder, cancelled = tmp_path_factory.mktemp("scancel"), []

    def cancel_after_two_epochs(job: dict[str, str]) -> None:
        if not cancelled and len(EPOCH_LINE.findall(output_of(folder, int(job["JobId"])))) >= 2:
            cancelled.append(cluster.command("scancel", job["JobId"]))

    return run_job(cluster, folder, 200, cancel_after_two_epochs)


@pytest.fixture(scope="module")
def time_limit_job(cluster, scancel_job, tmp_path_factory) -> Job:
    """A job whose time limit comes while it trains (the module's docstring), followed until it is COMPLETED. A job
    that finished before the signal came (the machine sped up since it was measured) is no test of the time limit:
    then one with enough epochs by its own measure runs instead."""
    runs = scancel_job.runs
    for _ in range(3):
        epoch_seconds = pd.read_csv(runs / files.CSV_NAME)["epoch_seconds"].min()
        job = limited_job(cluster, tmp_path_factory.mktemp("time-limit"), 1 + math.ceil(MORE_TRAINING / epoch_seconds))
        if re.search(EVENTS["stopped"], job.output, re.MULTILINE):
            return job
        runs = job.runs
    pytest.fail(f"three jobs finished before their time limit's signal came:\n{job.output}")


def limited_job(cluster, folder: Path, epochs: int) -> Job:
    """The job, its time limit shortened once it trains and set back once the script requeued it."""
    seen: dict[str, object] = {}

    def shorten_the_limit_once_it_trains(job: dict[str, str]) -> None:
        runs = folder / "runs" / job["JobId"]
        if "shortened" not in seen and job["JobState"] == "RUNNING" and csv_epochs(runs):
            # the limit (whole minutes) ends 90 to 150 s from now: the next look sends the signal, 60 s or more early
            minutes = (seconds(job["RunTime"]) + OFFSET + 30) // 60
            cluster.command("scontrol", "update", f"JobId={job['JobId']}", f"TimeLimit={minutes}")
            seen["shortened"] = minutes
        elif "shortened" in seen and "requeued" not in seen and int(job["Restarts"]) > 0:
            # the run ended and the script requeued the job: its files as the stop left them; the next start trains
            # to the end under the long limit again
            seen["requeued"] = (checkpoint_epoch(runs), csv_epochs(runs), sorted(p.name for p in runs.glob("*.tmp*")))
            cluster.command("scontrol", "update", f"JobId={job['JobId']}", f"TimeLimit={LONG_LIMIT}")

    job = run_job(cluster, folder, epochs, shorten_the_limit_once_it_trains)
    job.at_requeue = seen.get("requeued")
    return job


# ----------------------------------------------------------------------------- the tests


def test_two_nodes_train_and_only_global_rank_0_writes(time_limit_job):
    job = time_limit_job
    assert job.info["NodeList"] == "n[1-2]", job.info
    starts = [line for line in job.output.splitlines() if line.startswith(f"{model_name()}(")]
    assert starts and all("| 2 rank(s) on cpu (gloo) |" in line for line in starts), job.output  # a rank per node
    rows = pd.read_csv(job.runs / files.CSV_NAME)
    assert rows["loss"].iloc[-1] < rows["loss"].iloc[0], rows
    # one OUTPUT_DIR with rank 0's files, nothing else anywhere (both nodes see this folder)
    written = {str(path.relative_to(job.folder)) for path in job.folder.rglob("*") if not path.is_dir()}
    results = {f"runs/{job.id}/{name}" for name in (*files.RESULT_FILES, ".lock")}
    assert written == {"job.sh", "train_distribute.py", f"slurm-{job.id}.out", *results}, written
    assert job.writer_ranks == {"0"}, f"the OUTPUT_DIR lock was held by ranks {job.writer_ranks}"
    assert "\n[rank " not in job.output, job.output  # other ranks print nothing unless something fails
    printed = [int(epoch) for epoch, _ in EPOCH_LINE.findall(job.output)]
    assert printed == sorted(set(printed)) and len(printed) >= job.epochs - 1, job.output  # each epoch once at most


def test_time_limit_stops_every_rank_with_its_files_and_requeues_until_done(time_limit_job):
    job = time_limit_job
    assert (job.info["JobState"], job.info["ExitCode"], job.info["Restarts"]) == ("COMPLETED", "0:0", "1"), job.info
    assert_no_task_killed(job.output)
    seen = events(job.output)
    stops = [i for i, (kind, _) in enumerate(seen) if kind == "stopped"]
    assert len(stops) == 1, job.output  # rank 0 said which epoch's files the stop kept
    kept = assert_stop_kept_the_last_epoch(seen, stops[0])
    assert job.at_requeue == (kept, list(range(1, kept + 1)), []), job.at_requeue  # whole files of that epoch
    # the requeued job continued from them by itself (or, had the signal come as the last epoch ended, did nothing)
    after = seen[stops[0] + 1 :]
    assert after[:1] == ([("resumed", kept)] if kept < job.epochs else [("finished", kept)]), seen
    assert [epoch for kind, epoch in after if kind == "epoch"] == list(range(kept + 1, job.epochs + 1)), seen
    starts = re.findall(rf"^(?:{model_name()}\(|already finished:)", job.output, re.MULTILINE)
    assert len(starts) == 2, job.output  # the first start, and the requeued one
    assert csv_epochs(job.runs) == list(range(1, job.epochs + 1))
    assert checkpoint_epoch(job.runs) == job.epochs


def test_scancel_stops_the_run_with_its_files_whole_and_says_what_was_kept(scancel_job):
    job = scancel_job
    assert (job.info["JobState"], job.info["Restarts"]) == ("CANCELLED", "0"), job.info  # not requeued
    assert_no_task_killed(job.output)
    seen = events(job.output)
    stops = [i for i, (kind, _) in enumerate(seen) if kind == "stopped"]
    assert len(stops) == 1 and stops[0] == len(seen) - 1, job.output
    kept = assert_stop_kept_the_last_epoch(seen, stops[0])
    assert csv_epochs(job.runs) == list(range(1, kept + 1))
    assert checkpoint_epoch(job.runs) == kept
    assert sorted(path.name for path in job.runs.iterdir()) == sorted((*files.RESULT_FILES, ".lock"))


def test_requeue_of_the_completed_job_changes_nothing(cluster, time_limit_job):
    job = time_limit_job
    before, restarts = snapshot(job.runs), int(cluster.job(job.id)["Restarts"])
    cluster.command("scontrol", "requeue", str(job.id))
    info = cluster.wait(job.id, 180, lambda j: j["JobState"] in slurm_cluster.DONE and int(j["Restarts"]) > restarts)
    new = output_of(job.folder, job.id)[len(job.output) :]
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), new
    assert f"already finished: all {job.epochs} epochs are in runs/{job.id}; nothing to do" in new, new
    assert not EPOCH_LINE.search(new) and "resuming" not in new, new
    assert snapshot(job.runs) == before  # every file, .lock included, untouched
