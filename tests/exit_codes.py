"""`python train_distribute.py` as a user runs it (a new interpreter, its ranks spawned and torn down as at any
exit), recording what only the launcher and the ranks can see: each rank process's own exit code, as the
operating system reports it, and the threads each rank still had once it left the group.

    EXIT_CODES_DIR=OUT python -m tests.exit_codes SETTING...    # writes OUT/codes.json, OUT/threads<rank>.json

A module of its own that imports little: each spawned rank imports it again, to find its worker.
"""

import json
import os
import sys
from pathlib import Path

import processes

import train_distribute

OUT_DIR = os.environ.get("EXIT_CODES_DIR", "")


def recording_worker(rank: int, world_size: int, *args) -> None:
    """The project's whole rank; afterwards, which threads the process still has besides its main thread (which
    torch 2.4 names pt_main_thread as it is imported)."""
    train_distribute.main_worker(rank, world_size, *args)
    others = [t for t in os.listdir("/proc/self/task") if t != str(os.getpid())]
    names = sorted(Path(f"/proc/self/task/{t}/comm").read_text().strip() for t in others)
    Path(OUT_DIR, f"threads{rank}.json").write_text(json.dumps(names))


def recording_run_ranks(*args) -> tuple:
    codes, stop = run_ranks(*args)
    Path(OUT_DIR, "codes.json").write_text(json.dumps(codes))
    return codes, stop


if __name__ == "__main__":
    run_ranks = processes.run_ranks
    processes.run_ranks, train_distribute.main_worker = recording_run_ranks, recording_worker
    sys.exit(train_distribute.main(sys.argv[1:]))
