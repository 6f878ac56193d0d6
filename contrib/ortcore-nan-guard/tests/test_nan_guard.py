"""nan_guard's own tests, written with ortcore.testing's fixtures as any plugin author would."""

import pytest
import torch

import ortcore_nan_guard
from ortcore import ORTModule
from ortcore.api import OptionError
from ortcore.testing import assert_matches_torch


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Linear(4, 4)
        self.fragile = torch.nn.Sequential(torch.nn.Identity())
        self.head = torch.nn.Linear(4, 1)

    def forward(self, x):
        return self.head(torch.sqrt(self.fragile(self.inner(x))))


def test_first_non_finite_module_is_named(ortcore_host):
    host = ortcore_host({"nan_guard": ortcore_nan_guard})
    model = ORTModule(Model(), host=host)
    with torch.no_grad():
        model.inner.bias.fill_(-100.0)  # sqrt of negatives: NaN appears in the sqrt, after "fragile"
    with pytest.raises(ortcore_nan_guard.NonFiniteError, match="module 'head'"):
        model(torch.randn(3, 4))


def test_warn_action_keeps_training(ortcore_host):
    host = ortcore_host({"nan_guard": ortcore_nan_guard}, table={"plugins": {"nan_guard": {"action": "warn"}}})
    model = ORTModule(torch.nn.Linear(2, 2), host=host)
    with pytest.warns(RuntimeWarning, match="NaN or Inf"):
        model(torch.tensor([[float("inf"), 1.0]]))


def test_finite_steps_match_torch(ortcore_host):
    host = ortcore_host({"nan_guard": ortcore_nan_guard})
    assert_matches_torch(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU()), (torch.randn(5, 4),), host=host)


def test_bad_action_names_value_and_allowed(ortcore_host):
    with pytest.raises(OptionError, match=r"plugins\.nan_guard\.action='explode'.*raise, warn"):
        ortcore_host({"nan_guard": ortcore_nan_guard}, table={"plugins": {"nan_guard": {"action": "explode"}}})
