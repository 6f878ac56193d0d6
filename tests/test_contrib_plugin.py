"""The third-party route end to end: pip install contrib's plugin, see it listed, watch it act, switch it off."""

from __future__ import annotations

import importlib.util
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
def installed_nan_guard(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The environment of a process that sees contrib's nan_guard (installed into a directory of its own)."""
    return install_contrib("ortcore-nan-guard", tmp_path_factory.mktemp("site"))


def test_installing_the_plugin_for_these_tests_leaves_this_environment_as_it_was(installed_nan_guard, tmp_path):
    """Only processes given the install's directory see the plugin: ``import ortcore`` here, or in a process started
    without it, behaves as for someone who never ran the tests."""
    assert importlib.util.find_spec("ortcore_nan_guard") is None, (
        "ortcore_nan_guard is installed in this environment (an older version of these tests installed it): "
        "pip uninstall ortcore-nan-guard ortcore-activation-norms"
    )
    listing = run_in([sys.executable, "-m", "ortcore", "plugins"], tmp_path)
    assert listing.returncode == 0, listing.stderr
    assert "nan_guard" not in listing.stdout
    assert "nan_guard" in run_in([sys.executable, "-m", "ortcore", "plugins"], tmp_path, installed_nan_guard).stdout


def test_contrib_plugin_is_listed_acts_and_switches_off(installed_nan_guard, tmp_path):
    env = installed_nan_guard
    listing = run_in([sys.executable, "-m", "ortcore", "plugins"], tmp_path, env)
    assert listing.returncode == 0, listing.stderr
    row = next(line for line in listing.stdout.splitlines() if line.strip("│ ").startswith("nan_guard "))
    assert "ortcore-nan-guard" in row and "yes" in row

    (tmp_path / "train.py").write_text(SCRIPT)
    acting = run_in([sys.executable, "train.py"], tmp_path, env)
    assert acting.returncode != 0
    assert "NonFiniteError" in acting.stderr and "first produced by module 'head'" in acting.stderr

    (tmp_path / "ortcore.toml").write_text('[plugins]\ndisable = ["nan_guard"]\n')
    switched_off = run_in([sys.executable, "train.py"], tmp_path, env)
    assert switched_off.returncode == 0, switched_off.stderr
    assert "finished; finite: False" in switched_off.stdout
    listing = run_in([sys.executable, "-m", "ortcore", "plugins"], tmp_path, env)
    row = next(line for line in listing.stdout.splitlines() if line.strip("│ ").startswith("nan_guard "))
    assert "no (disabled)" in row
