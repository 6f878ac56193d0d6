"""``python -m ortcore_activation_norms plot``: reading the CSV, choosing activations, writing the image atomically."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ortcore_activation_norms import COLUMNS, NormSubscriber
from ortcore_activation_norms.plot import NormsFileError, l2_series, main, read_norms

PNG = b"\x89PNG\r\n\x1a\n"
HEADER = ",".join(COLUMNS) + "\n"


@pytest.fixture
def norms_csv(tmp_path):
    """A CSV as NormSubscriber writes it: 3 steps of a model whose ``block`` runs twice per step."""
    import torch

    path = tmp_path / "norms.csv"
    subscriber = NormSubscriber(path)
    for step in range(3):
        scale = float(step + 1)
        order = 0
        for name in ("embed", "block", "block", "head"):
            subscriber.on_forward(step, order, name, torch.full((2, 3), scale))
            order += 1
        for name in ("head", "block", "block", "embed"):
            subscriber.on_backward(step, order, name, torch.full((2, 3), -scale / 10))
            order += 1
        subscriber.on_step_end(step)
    return path


def test_read_norms_round_trips_the_subscriber_rows(norms_csv):
    rows = read_norms(norms_csv)
    assert len(rows) == 24
    first = rows[0]
    assert (first.step, first.order, first.kind, first.name, first.numel) == (0, 0, "forward", "embed", 6)
    assert first.l2 == pytest.approx(6**0.5, rel=1e-12) and first.rms == 1.0 and first.max_abs == 1.0


def test_names_with_commas_quotes_and_line_breaks_round_trip(tmp_path):
    import torch

    name = 'odd, "quoted"\nname'
    subscriber = NormSubscriber(tmp_path / "odd.csv")
    subscriber.on_forward(0, 0, name, torch.ones(4))
    subscriber.flush()
    (row,) = read_norms(tmp_path / "odd.csv")
    assert (row.name, row.numel, row.l2, row.rms, row.max_abs) == (name, 4, 2.0, 1.0, 1.0)


def test_series_per_activation_and_call(norms_csv):
    series = l2_series(read_norms(norms_csv), ["block*"], "forward")
    assert sorted(series) == [("forward", "block", 0), ("forward", "block", 1)]
    assert [s for s, _ in series[("forward", "block", 1)]] == [0, 1, 2]
    assert [v for _, v in series[("forward", "block", 0)]] == pytest.approx([6**0.5 * k for k in (1, 2, 3)])
    both = l2_series(read_norms(norms_csv), ["head"], "all")
    assert sorted(both) == [("backward", "head", 0), ("forward", "head", 0)]


def test_plot_writes_the_image_atomically(norms_csv, tmp_path, capsys):
    out = tmp_path / "plots" / "norms.png"
    out.parent.mkdir()
    assert main(["plot", str(norms_csv), "-o", str(out), "--name", "embed", "-n", "head", "--kind", "all"]) == 0
    assert out.read_bytes().startswith(PNG)
    assert os.listdir(out.parent) == ["norms.png"]  # no temporary file left
    assert f"wrote {out}" in capsys.readouterr().out


def test_a_failed_save_leaves_no_file(norms_csv, tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(Figure, "savefig", broken)
    with pytest.raises(OSError, match="disk full"):
        main(["plot", str(norms_csv), "-o", str(tmp_path / "out.png")])
    assert sorted(os.listdir(tmp_path)) == ["norms.csv"]


def test_module_entry_point(norms_csv, tmp_path):
    package_root = Path(__file__).parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(package_root), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-m", "ortcore_activation_norms", "plot", str(norms_csv), "-o", str(tmp_path / "n.svg")],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "n.svg").read_text().lstrip().startswith("<?xml")


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, r"missing\.csv: no such file; expected the CSV a NormSubscriber wrote"),
        ("", r"the file is empty; expected the header step, order, kind"),
        ("step,name,l2\n1,a,2\n", r"the columns are step, name, l2; expected step, order, kind, name, numel, l2"),
        (HEADER, r"the CSV has a header but no rows"),
        (HEADER + "0,0,forward,a,3,1.0,1.0\n", r"line 2: 7 fields; expected 8"),
        (
            HEADER + "0,0,sideways,a,3,1.0,1.0,1.0\n",
            r"line 2: kind='sideways' is not allowed; allowed: forward, backward",
        ),
        (HEADER + "x,0,forward,a,3,1.0,1.0,1.0\n", r"line 2: step='x' is not allowed; allowed: an integer >= 0"),
        (HEADER + "0,0,forward,a,3,big,1.0,1.0\n", r"line 2: l2='big' is not allowed; allowed: a number"),
        (HEADER + "0,0,forward,a,3,1.0,1.0,1.0\n0,1,backward,a,3,1.0,1.0,0.12", r"line 3: incomplete last row"),
        (HEADER + '0,0,forward,"a,3,1.0,1.0,1.0\n', r"line 2: unexpected end of data; expected a CSV file"),
    ],
)
def test_bad_csv_is_an_error_naming_the_value_and_what_is_allowed(tmp_path, capsys, content, message):
    path = tmp_path / "missing.csv"
    if content is not None:
        path.write_text(content)
    assert main(["plot", str(path), "-o", str(tmp_path / "out.png")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and re.search(message, err), err
    with pytest.raises(NormsFileError, match=message):
        l2_series(read_norms(path))
    assert not (tmp_path / "out.png").exists()


def test_choices_that_select_nothing_list_what_exists(norms_csv, tmp_path, capsys):
    assert main(["plot", str(norms_csv), "-o", str(tmp_path / "o.png"), "--name", "decoder.*"]) == 2
    err = capsys.readouterr().err
    assert "--name 'decoder.*' with --kind forward selects no activation; allowed: names" in err
    assert "among block, embed, head" in err


def test_bad_output_format_and_directory(norms_csv, tmp_path, capsys):
    assert main(["plot", str(norms_csv), "-o", str(tmp_path / "o.docx")]) == 2
    assert "format 'docx' is not allowed; allowed: " in capsys.readouterr().err
    assert main(["plot", str(norms_csv), "-o", str(tmp_path / "nowhere" / "o.png")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_bad_arguments_exit_2(norms_csv, tmp_path, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["plot", str(norms_csv), "-o", str(tmp_path / "o.png"), "--kind", "sideways"])
    assert exited.value.code == 2
    assert "invalid choice: 'sideways'" in capsys.readouterr().err
