"""README's SLURM batch script on a real two-node cluster (tests/slurm_cluster.py): training on both nodes, the
stop and requeue at the time limit, scancel, and a requeue of a finished job. Skipped without SLURM (not under
CI=true). One 30-epoch job with a 2-minute limit serves the first two tests and the last."""

import os
import re
from dataclasses import dataclass
from pathlib import Path

import outputs
import pandas as pd
import pytest

from tests import slurm_cluster
from tests.conftest import model_name, snapshot, width

pytestmark = pytest.mark.slurm

SETTINGS = ["--dataset=synthetic", "--synthetic_size=3000", *width(8), "--batch_size=64", "--epochs=30"]
EPOCHS = 30
# SLURM checks time limits every 30 s and signals up to 30 s early: at a 2-minute limit USR1 @60 comes 30 to 60 s
# after the start, 60 to 90 s before the limit. 30 epochs (90 s of training on a 2-core x86 CPU with AVX512-bf16, one
# CPU per node) need at least one requeue even where a core is 1.5x as fast.
TIME_LIMIT, SIGNAL_OFFSET = "2", 60
BROKEN = ("Killed", "Terminated", "exit code 137", "DUE TO TIME LIMIT")  # a task that did not stop by itself
EPOCH_LINE = re.compile(r"^epoch +(\d+)/(\d+) ", re.MULTILINE)
EVENTS = {
    "epoch": EPOCH_LINE.pattern,
    "stopped": r"^stopped by SIGTERM: (?:the files in \S+ are from epoch (\d+)|no epoch had finished)",
    "resumed": r"^resuming after epoch (\d+) ",
}


@dataclass
class Job:
    id: int
    folder: Path  # where it was submitted: its output, and runs/<id>/
    info: dict[str, str]  # scontrol's view once it ended
    output: str  # its output file then (later requeues append to it)
    writer_ranks: set[str]  # the RANK of each process seen holding the OUTPUT_DIR lock

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


def run_job(cluster, folder: Path, time_limit: str, while_running=lambda job: None) -> Job:
    """README's script with SETTINGS, submitted from `folder` and followed until it ends, with `while_running(job)`
    at every look; notes the rank of the process that holds the OUTPUT_DIR lock whenever one does."""
    job_id = cluster.submit(slurm_cluster.batch_script(time_limit, SIGNAL_OFFSET, SETTINGS), folder)
    writers: set[str] = set()

    def ended(job: dict[str, str]) -> bool:
        writers.update(lock_holder_rank(folder / "runs" / str(job_id)))
        while_running(job)
        return job["JobState"] in slurm_cluster.DONE

    info = cluster.wait(job_id, 600, ended)
    return Job(job_id, folder, info, output_of(folder, job_id), writers)


def output_of(folder: Path, job_id: int) -> str:
    path = folder / f"slurm-{job_id}.out"
    return path.read_text(errors="replace") if path.exists() else ""


def lock_holder_rank(runs: Path) -> set[str]:
    """{RANK of the process named in runs/.lock}, or {} if none is running now."""
    try:
        pid = re.search(r"pid=(\d+)", (runs / ".lock").read_text()).group(1)
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except (OSError, AttributeError):
        return set()
    return {v.decode() for k, _, v in (item.partition(b"=") for item in environ) if k == b"RANK"}


@pytest.fixture(scope="module")
def time_limit_job(cluster, tmp_path_factory) -> Job:
    """The 30-epoch job at the 2-minute limit, followed until it is COMPLETED (or gives up)."""
    return run_job(cluster, tmp_path_factory.mktemp("time-limit"), TIME_LIMIT)


def events(output: str) -> list[tuple[str, int]]:
    """("epoch", n), ("stopped", the epoch kept) and ("resumed", the epoch continued from), in the order printed."""
    found = [
        (match.start(), kind, int(match.group(1) or 0))
        for kind, pattern in EVENTS.items()
        for match in re.finditer(pattern, output, re.MULTILINE)
    ]
    return [(kind, epoch) for _, kind, epoch in sorted(found)]


def assert_no_task_killed(output: str) -> None:
    broken = [line for line in output.splitlines() if any(text in line for text in BROKEN)]
    assert not broken, "\n".join(broken)


def csv_epochs(runs: Path) -> list[int]:
    return pd.read_csv(runs / outputs.CSV_NAME)["epoch"].tolist()


def test_two_nodes_train_and_only_global_rank_0_writes(time_limit_job):
    job = time_limit_job
    assert job.info["NodeList"] == "n[1-2]", job.info
    starts = [line for line in job.output.splitlines() if line.startswith(f"{model_name()}(")]
    assert starts and all("| 2 rank(s) on cpu (gloo) |" in line for line in starts), job.output  # a rank per node
    rows = pd.read_csv(job.runs / outputs.CSV_NAME)
    assert rows["loss"].iloc[-1] < rows["loss"].iloc[0], rows
    # one OUTPUT_DIR with rank 0's files, nothing else anywhere (both nodes see this folder)
    files = {str(path.relative_to(job.folder)) for path in job.folder.rglob("*") if not path.is_dir()}
    results = {f"runs/{job.id}/{name}" for name in (*outputs.RESULT_FILES, ".lock")}
    assert files == {"job.sh", "train_distribute.py", f"slurm-{job.id}.out", *results}, files
    assert job.writer_ranks == {"0"}, f"the OUTPUT_DIR lock was held by ranks {job.writer_ranks}"
    assert "\n[rank " not in job.output, job.output  # other ranks print nothing unless something fails
    assert EPOCH_LINE.findall(job.output) == [(str(e), str(EPOCHS)) for e in range(1, EPOCHS + 1)], job.output


def test_time_limit_stops_every_rank_with_its_files_and_requeues_until_done(time_limit_job):
    job = time_limit_job
    assert (job.info["JobState"], job.info["ExitCode"]) == ("COMPLETED", "0:0"), job.output
    assert_no_task_killed(job.output)
    seen = events(job.output)
    stops = [i for i, (kind, _) in enumerate(seen) if kind == "stopped"]
    assert stops, f"the job never reached its time limit's signal: make the run longer\n{job.output}"
    for i in stops:
        printed = [epoch for kind, epoch in seen[:i] if kind == "epoch"]
        assert seen[i][1] == (printed[-1] if printed else 0), seen  # the checkpoint holds the last epoch printed
        assert ("resumed", seen[i][1]) in seen[i + 1 : i + 2] or seen[i][1] == 0, seen  # and the requeue continues
    # every start prints the first line, or (the signal came as the run ended) that it had already finished
    starts = len(re.findall(rf"^(?:{model_name()}\(|already finished:)", job.output, re.MULTILINE))
    assert int(job.info["Restarts"]) == starts - 1 >= len(stops), job.info
    assert csv_epochs(job.runs) == list(range(1, EPOCHS + 1))
    assert outputs.checkpoint_epoch(str(job.runs)) == EPOCHS


def test_scancel_stops_the_run_with_its_files_whole_and_says_what_was_kept(cluster, tmp_path_factory):
    folder, cancelled = tmp_path_factory.mktemp("scancel"), []

    def cancel_after_the_first_epoch(job: dict[str, str]) -> None:
        if not cancelled and EPOCH_LINE.search(output_of(folder, int(job["JobId"]))):
            cancelled.append(cluster.command("scancel", job["JobId"]))

    job = run_job(cluster, folder, "10", cancel_after_the_first_epoch)
    assert (job.info["JobState"], job.info["Restarts"]) == ("CANCELLED", "0"), job.info  # not requeued
    assert_no_task_killed(job.output)
    printed = [int(epoch) for epoch, _ in EPOCH_LINE.findall(job.output)]
    kept = re.search(rf"^stopped by SIGTERM: the files in runs/{job.id} are from epoch (\d+)", job.output, re.M)
    assert kept and int(kept.group(1)) == printed[-1], job.output
    assert csv_epochs(job.runs) == printed
    assert outputs.checkpoint_epoch(str(job.runs)) == printed[-1]
    assert sorted(path.name for path in job.runs.iterdir()) == sorted((*outputs.RESULT_FILES, ".lock"))


def test_requeue_of_the_completed_job_changes_nothing(cluster, time_limit_job):
    job = time_limit_job
    before, restarts = snapshot(job.runs), int(cluster.job(job.id)["Restarts"])
    cluster.command("scontrol", "requeue", str(job.id))
    info = cluster.wait(job.id, 180, lambda j: j["JobState"] in slurm_cluster.DONE and int(j["Restarts"]) > restarts)
    new = output_of(job.folder, job.id)[len(job.output) :]
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), new
    assert f"already finished: all {EPOCHS} epochs are in runs/{job.id}; nothing to do" in new, new
    assert not EPOCH_LINE.search(new) and "resuming" not in new, new
    assert snapshot(job.runs) == before  # every file, .lock included, untouched
