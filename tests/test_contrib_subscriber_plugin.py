"""A third-party subscriber plugin end to end: pip install contrib's activation_norms, see it listed, import its
subscriber class from ortcore.hooks, let ortcore.toml switch it on for an ORTModule run, and switch it off.

Three subprocesses only (each pays for importing torch); the contrib package's own tests cover the rest.
"""

from __future__ import annotations

import csv
import sys
import textwrap

import pytest
from models import install_contrib, run_in

SCRIPT = textwrap.dedent(
    """
    import torch
    import ortcore.hooks
    from ortcore import ORTModule
    from ortcore.hooks import GlobalSubscriberManager

    try:
        from ortcore.hooks import NormSubscriber
        print("NormSubscriber from", NormSubscriber.__module__)
    except ImportError:
        print("no NormSubscriber; subscriber classes:", sorted(ortcore.hooks.subscriber_classes()))

    model = ORTModule(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 1)))
    GlobalSubscriberManager.subscribe(model, [])  # ortcore.toml decides what is recorded
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        optimizer.zero_grad()
        model(torch.randn(5, 4)).square().mean().backward()
        optimizer.step()
    print("ran in ORT:", model.fallback_reason is None)
    """
)
ENABLED = '[plugins.activation_norms]\nenabled = true\noutput_path = "norms.csv"\n'




def _row(listing: str) -> str:
    return next(line for line in listing.splitlines() if line.strip("│ ").startswith("activation_norms "))


@pytest.fixture(scope="module")
def installed_activation_norms(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The environment of a process that sees contrib's activation_norms (installed into a directory of its own)."""
    return install_contrib("ortcore-activation-norms", tmp_path_factory.mktemp("site"))


def test_contrib_subscriber_plugin_is_listed_imports_records_and_switches_off(installed_activation_norms, tmp_path):
    env = installed_activation_norms
    listing = run_in([sys.executable, "-m", "ortcore", "plugins"], tmp_path, env)
    assert listing.returncode == 0, listing.stderr
    row = _row(listing.stdout)
    assert "ortcore-activation-norms" in row and "yes" in row

    (tmp_path / "train.py").write_text(SCRIPT)
    (tmp_path / "ortcore.toml").write_text(ENABLED)
    recording = run_in([sys.executable, "train.py"], tmp_path, env)
    assert recording.returncode == 0, recording.stderr
    assert "NormSubscriber from ortcore_activation_norms.subscriber" in recording.stdout
    assert "ran in ORT: True" in recording.stdout
    with open(tmp_path / "norms.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    names = {"0", "1", "2", "Sequential"}
    assert {(int(r["step"]), r["kind"], r["name"]) for r in rows} == {
        (step, kind, name) for step in range(3) for kind in ("forward", "backward") for name in names
    }
    assert all(float(r["l2"]) > 0 for r in rows)

    (tmp_path / "norms.csv").unlink()
    (tmp_path / "ortcore.toml").write_text('[plugins]\ndisable = ["activation_norms"]\n\n' + ENABLED)
    disabled = run_in([sys.executable, "train.py"], tmp_path, env)
    assert disabled.returncode == 0, disabled.stderr
    assert "ran in ORT: True" in disabled.stdout and not (tmp_path / "norms.csv").exists()
    assert "no NormSubscriber; subscriber classes:" in disabled.stdout  # the plugin was never imported
