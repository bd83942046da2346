"""The process model with real processes: device and backend, ports, threads, and failures."""

import copy
import json
import os
import socket
import time

import processes
import pytest
import torch

import distribute_tools as dt
from tests.conftest import call, clean_env, run_script


@pytest.fixture(autouse=True)
def own_environment():
    saved = dict(os.environ)
    for name in ("MASTER_PORT", "MASTER_ADDR", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        os.environ.pop(name, None)
    yield
    os.environ.clear()
    os.environ.update(saved)


def reports(out_dir, world_size):
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world_size)]


def test_cpu_gets_gloo_and_two_processes():
    assert dt.choose_device(0, 2) == (torch.device("cpu"), "gloo")
    assert dt.resolve_world_size(0) == 2
    assert dt.resolve_world_size(3) == 3
    with pytest.raises(processes.UserError, match="negative"):
        dt.resolve_world_size(-1)


def test_a_strided_pointwise_convolution_of_few_channels_is_routed_around_the_crashing_kernel():
    """On CPUs the strided 1x1 convolutions with at most 8 input channels subsample first, then run with stride 1:
    the same outputs and gradients. Wider ones, and every one on other devices, are left as they are."""
    torch.manual_seed(0)
    narrow, wide = torch.nn.Conv2d(8, 16, 1, stride=2), torch.nn.Conv2d(16, 32, 1, stride=2)
    routed = copy.deepcopy(narrow)
    dt.route_around_cpu_crashes(torch.nn.Sequential(routed, wide), torch.device("cpu"))
    assert routed.stride == (1, 1) and wide.stride == (2, 2) and not wide._forward_pre_hooks
    x = torch.randn(2, 8, 9, 9)
    expected, got = narrow(x), routed(x)
    assert got.shape == expected.shape == (2, 16, 5, 5) and torch.allclose(got, expected, atol=1e-6)
    expected.square().sum().backward()
    got.square().sum().backward()
    assert torch.allclose(routed.weight.grad, narrow.weight.grad, atol=1e-5)
    on_gpu = copy.deepcopy(narrow)
    dt.route_around_cpu_crashes(on_gpu, torch.device("cuda", 0))
    assert on_gpu.stride == (2, 2)


def test_torchrun_decides_the_world_size(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "6")
    assert dt.under_torchrun() and dt.resolve_world_size(2) == 6
    assert "warning: WORLD_SIZE=2 is ignored under torchrun, which started 6 ranks" in capsys.readouterr().out


def test_spawned_ranks_with_a_free_port_while_the_usual_ones_are_taken(tmp_path):
    held = []
    for port in (12355, 29500):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("0.0.0.0", port))
            s.listen()
            held.append(s)
        except OSError:  # already taken by something else: just as good for this test
            s.close()
    try:
        assert call("tests.workers:start", "report_worker", 2, str(tmp_path)).returncode == 0
    finally:
        for s in held:
            s.close()
    facts = reports(tmp_path, 2)
    assert [f["rank"] for f in facts] == [0, 1] and [f["is_main"] for f in facts] == [True, False]
    assert {f["backend"] for f in facts} == {"gloo"} and {f["device"] for f in facts} == {"cpu"}
    assert {f["master_addr"] for f in facts} == {"127.0.0.1"}
    port = {f["master_port"] for f in facts}
    assert len(port) == 1 and port.isdisjoint({"12355", "29500"})
    # the ranks of one machine share its cores instead of each taking all of them
    assert {f["threads"] for f in facts} == {max(1, dt.cpu_cores() // 2)}


def test_master_port_from_the_environment_is_honoured(tmp_path):
    port = str(processes.free_port())
    assert (
        call("tests.workers:start", "report_worker", 2, str(tmp_path), env=clean_env(MASTER_PORT=port)).returncode == 0
    )
    assert {f["master_port"] for f in reports(tmp_path, 2)} == {port}


def test_a_raising_worker_ends_the_run_and_names_its_rank(tmp_path):
    env = clean_env(MASTER_PORT=str(processes.free_port()))
    started = time.monotonic()
    result = call("tests.workers:start", "raising_worker", 2, env=env)
    assert result.returncode == 1 and time.monotonic() - started < 60
    assert "[rank 1] failed with RuntimeError" in result.stderr
    assert "[rank 1] RuntimeError: raised on purpose by the test" in result.stderr
    assert "[rank 0] Traceback" not in result.stderr  # the rank that lost its peer says so in one line, if at all
    # the port is released: an immediate rerun on the same port works
    assert call("tests.workers:start", "report_worker", 2, str(tmp_path), env=env).returncode == 0
    assert {f["master_port"] for f in reports(tmp_path, 2)} == {env["MASTER_PORT"]}


def test_a_rank_stuck_outside_collectives_times_out_the_others():
    started = time.monotonic()
    result = call("tests.workers:start", "hanging_worker", 2, 3.0)
    assert result.returncode != 0
    assert time.monotonic() - started < 30, "the collective timeout did not end the run"
    assert "[rank 0] failed with" in result.stderr


def test_more_ranks_than_gpus_is_refused_before_anything_starts(monkeypatch):
    monkeypatch.setattr(dt, "gpu_count", lambda: 2)
    assert dt.resolve_world_size(0) == 2 and dt.resolve_world_size(1) == 1
    with pytest.raises(processes.UserError, match="WORLD_SIZE=3 but this machine has 2 GPU"):
        dt.resolve_world_size(3)
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(
        processes.UserError, match=r"two ranks would share a GPU; start one process per GPU \(--nproc_per_node=2\)"
    ):
        dt.resolve_world_size(0)


@pytest.mark.parametrize(
    "visible,local_rank,local_world_size,expected",
    [
        (8, 3, 8, "cuda:3"),  # every GPU of the machine visible: GPU LOCAL_RANK
        (8, 1, 2, "cuda:1"),  # fewer ranks than GPUs
        (1, 3, 8, "cuda:0"),  # one GPU visible per process (SLURM --gpus-per-task=1): that one
        (1, 0, 1, "cuda:0"),
    ],
)
def test_each_rank_gets_its_own_gpu_in_every_layout(monkeypatch, visible, local_rank, local_world_size, expected):
    monkeypatch.setattr(dt, "gpu_count", lambda: visible)
    assert dt.choose_device(local_rank, local_world_size) == (torch.device(expected), "nccl")


def test_two_ranks_never_share_a_gpu(monkeypatch):
    monkeypatch.setattr(dt, "gpu_count", lambda: 2)
    with pytest.raises(processes.UserError, match="4 processes on this machine but each sees 2 GPUs"):
        dt.choose_device(3, 4)


def fake_nvidia_smi(tmp_path, monkeypatch):
    """A stand-in nvidia-smi on PATH that lists two GPUs, as on a machine whose torch cannot use them."""
    tool = tmp_path / "nvidia-smi"
    tool.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H200 (UUID: GPU-1)'\necho 'GPU 1: NVIDIA H200 (UUID: GPU-2)'\n")
    tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")


def test_gpus_torch_cannot_use_stop_the_run_unless_the_cpu_is_asked_for(tmp_path, monkeypatch):
    fake_nvidia_smi(tmp_path, monkeypatch)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    with pytest.raises(
        processes.UserError, match="nvidia-smi shows 2 GPU.* but torch .* cannot use them.*CUDA_VISIBLE_DEVICES="
    ):
        dt.resolve_world_size(0)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # the CPU on purpose
    assert dt.resolve_world_size(0) == 2 and dt.choose_device(0, 2)[1] == "gloo"


def test_gpus_torch_cannot_use_are_one_line_before_anything_starts(tmp_path, monkeypatch):
    fake_nvidia_smi(tmp_path, monkeypatch)
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    result = run_script("--dataset=synthetic", f"--output_dir={tmp_path / 'out'}", env=env)
    assert result.returncode == 2 and "Traceback" not in result.stderr and result.stdout == ""
    assert len(result.stderr.strip().splitlines()) == 1 and "nvidia-smi shows 2 GPU(s)" in result.stderr
    assert not (tmp_path / "out").exists()


def test_a_rank_whose_launcher_is_already_gone_leaves_at_once():
    """The launcher can die between starting a rank and the rank asking to die with it."""
    result = call("tests.workers:die_with_parent_1")
    assert result.returncode == processes.EXIT_PREEMPTED and "still here" not in result.stdout


def test_the_launcher_names_the_rank_that_failed_and_not_one_that_lost_its_peer(capsys):
    """Ranks that end within one poll of the launcher come in rank order: rank 0, stopped because rank 1 failed,
    must not be the one named."""
    assert processes._explain({0: processes.EXIT_PEER_LOST, 1: 1}, 0) == 1
    assert capsys.readouterr().err.startswith("error: rank 1 exited with code 1; stopped the other ranks")
    assert processes._explain({0: processes.EXIT_PEER_LOST, 1: processes.EXIT_USER_ERROR}, 0) == 2
