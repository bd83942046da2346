"""Files in OUTPUT_DIR: atomic writes, moving an earlier run aside, leftovers of a killed run."""
import pytest

import outputs


def test_a_failed_write_leaves_the_previous_file_whole(tmp_path):
    target = tmp_path / "pytorch_res.csv"
    outputs.write_atomically(str(target), lambda tmp: open(tmp, "w").write("epoch\n1\n"))

    def crash_halfway(tmp):
        open(tmp, "w").write("epo")
        raise OSError("disk full")

    with pytest.raises(OSError):
        outputs.write_atomically(str(target), crash_halfway)
    assert target.read_text() == "epoch\n1\n"
    assert [p.name for p in tmp_path.iterdir()] == ["pytorch_res.csv"]


def test_earlier_results_move_aside_and_nothing_else_moves(tmp_path):
    for name in outputs.RESULT_FILES:
        (tmp_path / name).write_text(name)
    (tmp_path / "notes.txt").write_text("mine")
    moved_to = outputs.move_aside_earlier_results(str(tmp_path))
    assert moved_to and sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == ["notes.txt"]
    for name in outputs.RESULT_FILES:
        assert (tmp_path / moved_to / name).read_text() == name
    (tmp_path / "pytorch_res.csv").write_text("second")
    second = outputs.move_aside_earlier_results(str(tmp_path))
    assert second != moved_to and (tmp_path / second / "pytorch_res.csv").read_text() == "second"
    assert outputs.move_aside_earlier_results(str(tmp_path / "never-used")) is None


def test_temporaries_of_a_killed_run_are_removed(tmp_path):
    (tmp_path / "checkpoint.pt.tmp4242").write_text("half")
    (tmp_path / "pytorch_res.csv").write_text("whole")
    outputs.remove_stale_temporaries(str(tmp_path))
    assert [p.name for p in tmp_path.iterdir()] == ["pytorch_res.csv"]


def test_summary_names_best_and_final(tmp_path):
    history = [{"epoch": 1, "acc": 0.5, "images_per_second": 100.0}, {"epoch": 2, "acc": 0.4, "images_per_second": 300.0}]
    line = outputs.summary_line(history, 75, str(tmp_path))
    assert "best acc 0.5000 (epoch 1)" in line and "final acc 0.4000" in line and "200 img/s" in line
    assert "1m15s" in line
