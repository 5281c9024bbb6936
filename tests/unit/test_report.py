"""``python -m mpidp.report``: pictures of a run from its JSON log (tier 1: a log written here,
no MPI)."""
import json

from mpidp import report


def _log(path, epochs=3, ranks=2, finished=True):
    lines = []
    for e in range(1, epochs + 1):
        lines.append({"event": "epoch", "epoch": e, "epochs": epochs, "train_loss": 1.0 / e,
                      "test_accuracy": None if e == 1 else 0.5 + 0.1 * e,
                      "samples_per_s": 1000.0 * e, "time_s": 0.5,
                      "ranks": [{"rank": r, "compute_s": 0.2 * (r + 1), "wait_s": 0.1,
                                 "samples": 100, "time_s": 0.5} for r in range(ranks)]})
        if e == 1:
            lines.append({"event": "straggler", "rank": ranks - 1, "epoch": 1, "host": "h",
                          "slowdown": 2.0})
    if finished:
        lines.append({"event": "summary", "strategy": "mirrored", "ranks": ranks,
                      "model": "mlp", "dataset": "digits", "epochs": epochs,
                      "final_accuracy": 0.8, "samples_per_s": 2000.0})
    path.write_text("".join(json.dumps(l) + "\n" for l in lines))
    return path


def test_a_run_is_drawn_and_bad_logs_get_one_line(tmp_path, capsys):
    log = _log(tmp_path / "run.jsonl")
    assert report.main([str(log)]) == 0
    png = tmp_path / "run.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20000
    assert capsys.readouterr().out == (f"mpidp.report: wrote {png}: loss and accuracy per "
                                       "epoch, samples/s, each rank's compute and wait\n")
    ranks, compute, wait, samples = report.per_rank(report.read_run(log)["epochs"])
    assert ranks == [0, 1] and samples == [300, 300] and wait == [0.1 * 3] * 2
    assert compute == [0.2 * 3, 0.4 * 3]
    unfinished = _log(tmp_path / "cut.jsonl", finished=False)
    assert report.main([str(unfinished), "--out", str(tmp_path / "cut.png")]) == 0
    assert "did not finish" in report.title_of(report.read_run(unfinished), unfinished)
    (tmp_path / "bad.jsonl").write_text('{"event": "epoch"\n')
    for bad, said in ((tmp_path / "bad.jsonl", "bad.jsonl:1: not a line of python -m "
                       "mpidp.train --log-json"), (tmp_path / "none.jsonl", "cannot read")):
        capsys.readouterr()
        assert report.main([str(bad)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("mpidp.report: error: ") and said in err and err.count("\n") == 1


def test_the_last_line_a_person_reads():
    from mpidp.train.metrics import ending
    run = {"final_accuracy": 0.9833, "epochs": 20, "ranks": 2, "total_s": 0.51,
           "samples_per_s": 57234.4, "checkpoint": "c/ckpt-000000460.pt"}
    assert ending(run, "log.jsonl") == (
        "mpidp.train: done: 98.33% held-out accuracy after 20 epochs on 2 rank(s); 0.5 s of "
        "training, 57,234 samples/s; checkpoint c/ckpt-000000460.pt, JSON log log.jsonl")
    ps = dict(run, final_accuracy=None, final_train_loss=0.25, epochs=1, checkpoint=None,
              workers=2, servers=1)
    assert ending(ps) == ("mpidp.train: done: train loss 0.2500 after 1 epoch on 2 worker(s) "
                          "+ 1 server(s); 0.5 s of training, 57,234 samples/s")
    assert "nothing left to train" in ending(dict(ps, final_train_loss=None))


def test_size_labels_read_as_a_person_reads_them():
    from mpidp.bench.allreduce import size_label
    assert [size_label(x) for x in (8, 4096, 1 << 20, 64 << 20, 1 << 30)] == \
        ["8 B", "4 KiB", "1 MiB", "64 MiB", "1 GiB"]


def test_one_loader_reads_json_and_json_lines(tmp_path):
    """mpidp.report.records.load: a .json file's value, JSON lines' records (blank lines
    skipped; ``lines=True`` whatever the name), and an error naming the file and line."""
    from mpidp.report import records
    (tmp_path / "a.json").write_text('{"rows": [1, 2]}')
    (tmp_path / "b.jsonl").write_text('{"x": 1}\n\n{"x": 2}\n')
    (tmp_path / "c.log").write_text('{"x": 3}\n')
    (tmp_path / "d.jsonl").write_text('{"x": 1}\nnot json\n')
    assert records.load(tmp_path / "a.json") == {"rows": [1, 2]}
    assert records.load(tmp_path / "b.jsonl") == [{"x": 1}, {"x": 2}]
    assert records.load(tmp_path / "c.log", lines=True) == [{"x": 3}]
    for bad, said in (("d.jsonl", "d.jsonl:2: not a line of JSON"), ("e.json", "cannot read")):
        try:
            records.load(tmp_path / bad)
        except ValueError as exc:
            assert said in str(exc), exc
        else:
            raise AssertionError(f"{bad} was read")


def test_the_straggler_summary_reads_train_logs_through_the_loader(tmp_path):
    """bench/training/summarize_straggler.py reads mpidp.train's logs with read_run: two
    conditions' runs give their rows and ratios to mirrored."""
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).parent.parent.parent
    for name in ("local.mirrored.0.jsonl", "local.ps.0.jsonl"):
        _log(tmp_path / name)
    out = subprocess.run([sys.executable, root / "bench/training/summarize_straggler.py",
                          tmp_path, "--target", "0.7"], capture_output=True, text=True,
                         timeout=60, cwd=root)
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if line.startswith("| one machine")]
    assert len(rows) == 2 and all("| 1.00× | 1.00 | 80.00% | 1 |" in r for r in rows), out.stdout
