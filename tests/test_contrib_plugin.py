"""The third-party route end to end: pip install contrib's plugin, see it listed, watch it act, switch it off."""

from __future__ import annotations

import sys
import textwrap

import pytest
from models import install_contrib, run_in

SCRIPT = textwrap.dedent(
    """
    import torch
    from ortcore import ORTModule

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = torch.nn.Linear(4, 4)
            self.head = torch.nn.Linear(4, 1)

        def forward(self, x):
            return self.head(torch.log(self.inner(x)))

    model = ORTModule(Model())
    with torch.no_grad():
        model.inner.bias.fill_(-100.0)
    out = model(torch.randn(3, 4))
    print("finished; finite:", bool(torch.isfinite(out).all()))
    """
)




@pytest.fixture(scope="module")
def installed_nan_guard():
    install_contrib("ortcore-nan-guard", "ortcore_nan_guard")


def test_contrib_plugin_is_listed_acts_and_switches_off(installed_nan_guard, tmp_path):
    listing = run_in([sys.executable, "-m", "ortcore", "plugins"], tmp_path)
    assert listing.returncode == 0, listing.stderr
    row = next(line for line in listing.stdout.splitlines() if line.strip("│ ").startswith("nan_guard "))
    assert "ortcore-nan-guard" in row and "yes" in row

    (tmp_path / "train.py").write_text(SCRIPT)
    acting = run_in([sys.executable, "train.py"], tmp_path)
    assert acting.returncode != 0
    assert "NonFiniteError" in acting.stderr and "first produced by module 'head'" in acting.stderr

    (tmp_path / "ortcore.toml").write_text('[plugins]\ndisable = ["nan_guard"]\n')
    switched_off = run_in([sys.executable, "train.py"], tmp_path)
    assert switched_off.returncode == 0, switched_off.stderr
    assert "finished; finite: False" in switched_off.stdout
    listing = run_in([sys.executable, "-m", "ortcore", "plugins"], tmp_path)
    row = next(line for line in listing.stdout.splitlines() if line.strip("│ ").startswith("nan_guard "))
    assert "no (disabled)" in row
