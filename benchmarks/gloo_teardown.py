"""Does leaving a gloo process group hang? Pairs of rank processes (new interpreters) each run rounds of what a rank
does around its end: join a group, all_gather_object, all_reduce, barrier, destroy_process_group. `plain` destroys
as torch's documentation has it; `kept` through safeguards.failures.kept_alive, as distribute_tools.cleanup does. A
rank stuck 20 s in a round counts its pair as stuck. Busy processes beside them (--load) make the rare hang common.

    python -m benchmarks.gloo_teardown                      # 10 pairs x 50 rounds each way, 2 busy processes
    python -m benchmarks.gloo_teardown --pairs 20 --load 0  # a quiet machine
    python -m benchmarks.gloo_teardown --ways kept          # ours alone (the plain way waits 20 s per stuck pair)

Prints, for each way, how many pairs got stuck. torch 2.4 to 2.7 free a group holding Python's lock while joining
threads that may need it (pytorch#154976); 2.8 and later should show no stuck pair either way.
"""

import argparse
import datetime
import faulthandler
import os
import subprocess
import sys
import time

import torch
import torch.distributed as dist


def rank(index: int, port: int, rounds: int, way: str) -> None:
    """One rank's rounds; exits 1 (faulthandler's watchdog) when a round takes more than 20 s."""
    from safeguards import failures

    store = dist.TCPStore("127.0.0.1", port, 2, index == 0, timeout=datetime.timedelta(seconds=15))
    quiet = open(os.devnull, "w")  # noqa: SIM115 (the watchdog writes into it until the process ends)
    for n in range(rounds):
        faulthandler.dump_traceback_later(20, exit=True, file=quiet)
        dist.init_process_group("gloo", store=dist.PrefixStore(str(n), store), rank=index, world_size=2)
        dist.all_gather_object([None, None], {"rank": index, "round": n})
        dist.all_reduce(torch.ones(3))
        dist.barrier()
        dist.destroy_process_group(failures.kept_alive(dist.group.WORLD) if way == "kept" else None)
        faulthandler.cancel_dump_traceback_later()
    sys.stdout.flush()
    os._exit(0)  # as run_rank ends a rank: a kept group is never freed


def stuck_pairs(pairs: int, rounds: int, way: str) -> int:
    stuck = 0
    for pair in range(pairs):
        port = 20000 + (os.getpid() * 7 + pair) % 20000
        command = [sys.executable, "-m", "benchmarks.gloo_teardown", "--rank", "{}", "--port", str(port)]
        command += ["--rounds", str(rounds), "--way", way]
        both = [subprocess.Popen([a.format(i) for a in command]) for i in (0, 1)]
        codes = [p.wait() for p in both]
        stuck += any(codes)
    return stuck


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=10, help="pairs of ranks each way")
    parser.add_argument("--rounds", type=int, default=50, help="rounds of join, collectives, destroy per pair")
    parser.add_argument("--load", type=int, default=2, help="busy processes beside the ranks")
    parser.add_argument("--ways", default="plain,kept", help="which ways, comma-separated")
    parser.add_argument("--rank", type=int, default=-1, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--way", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank >= 0:
        return rank(args.rank, args.port, args.rounds, args.way)
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.load)]
    try:
        print(f"torch {torch.__version__}, {args.pairs} pairs x {args.rounds} rounds each way, {args.load} busy")
        for way in args.ways.split(","):
            started = time.perf_counter()
            stuck = stuck_pairs(args.pairs, args.rounds, way)
            print(f"{way}: {stuck} of {args.pairs} pairs stuck ({time.perf_counter() - started:.0f} s)", flush=True)
    finally:
        for process in busy:
            process.kill()


if __name__ == "__main__":
    main()
