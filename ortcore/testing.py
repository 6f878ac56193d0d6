"""Test helpers and pytest fixtures for plugin authors (ortcore's own tests use them too).

Opt-in, so that other projects' pytest runs never import torch because ortcore is installed: load it with
``pytest -p ortcore.testing`` or a ``conftest.py`` line ``pytest_plugins = ["ortcore.testing"]``, then::

    def test_my_plugin_keeps_gradients(ortcore_host, tmp_path):
        host = ortcore_host({"my_plugin": my_plugin}, table={"plugins": {"my_plugin": {"level": 2}}})
        model = torch.nn.Linear(4, 2)
        assert_matches_torch(model, (torch.randn(3, 4),), host=host)

``ortcore_host`` builds a :class:`~ortcore.host.PluginHost` with no autoloading: only the plugins you pass are
registered, besides the one offering the default exporter (``torchscript_exporter``, which every host has). :func:`assert_matches_torch` runs a model in plain PyTorch and in ortcore
from identical weights and compares outputs, loss and every parameter's gradient.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import pytest
import torch
import torch.utils._pytree as pytree

from .config import Config
from .host import PluginHost, set_host
from .markers import hookimpl

AUDIT_PLUGIN = "gradient_audit"  # registered on test hosts by default (make_host)
RTOL = 1e-4
ATOL = 1e-5


class _ActivationBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(6, 6)
        self.act = torch.nn.GELU()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        from .hooks import inspect_activation

        hidden = inspect_activation("block.hidden", self.fc(x) * 2)
        return self.act(hidden), {"skip": x + 1}


class ActivationNet(torch.nn.Module):
    """A small model for activation-subscriber tests (inputs of shape ``(batch, 4)``): a submodule returning a
    tuple holding a dict, a named intermediate (``inspect_activation``), LayerNorm and Linear layers. A subscriber
    sees the activations named in :data:`ACTIVATION_NET_NAMES`, forward and backward."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(4, 6)
        self.block = _ActivationBlock()
        self.norm = torch.nn.LayerNorm(6)
        self.head = torch.nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, extra = self.block(self.embed(x))
        return self.head(self.norm(out + extra["skip"]))


ACTIVATION_NET_NAMES = frozenset(
    {"ActivationNet", "embed", "block.fc", "block.hidden", "block.act", "block[0]", "block[1]['skip']", "norm", "head"}
)


def make_host(
    plugins: Mapping[str, Any] | None = None,
    *,
    table: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    audit: bool = True,
) -> PluginHost:
    """A plugin host with only ``plugins`` registered (and the default exporter's plugin, and gradient_fixes' lowering
    of detach() markers: :data:`ortcore.host.STOP_GRADIENT_LOWERING`), configured from ``table`` (an ortcore.toml as
    a dict).

    With ``audit`` (the default) the installed ``gradient_audit`` plugin is registered too, so that every model a
    test trains on such a host has its first step checked against PyTorch as it would by default.

    Unless ``env`` says otherwise, a host with the ``aten_fallback`` plugin times no kernel
    (``ORTCORE_KERNEL_MEASURE=off``: its kernel choice keeps the default list where no earlier measurement decided),
    so a test's graph does not depend on how fast the machine running it is."""
    env = dict(env or {})
    if "aten_fallback" in (plugins or {}):
        env.setdefault("ORTCORE_KERNEL_MEASURE", "off")
    config = Config.from_table(table or {}, env=env)
    return PluginHost(config, autoload=False, plugins=plugins or {}, builtins=(AUDIT_PLUGIN,) if audit else ())


@pytest.fixture
def ortcore_host() -> Iterator[Callable[..., PluginHost]]:
    """Factory fixture: ``ortcore_host(plugins, table=..., env=...)``; hosts are closed after the test."""
    hosts: list[PluginHost] = []

    def factory(plugins: Mapping[str, Any] | None = None, **kwargs: Any) -> PluginHost:
        host = make_host(plugins, **kwargs)
        hosts.append(host)
        return host

    yield factory
    for host in hosts:
        host.close()


@pytest.fixture
def ortcore_default_host(ortcore_host: Callable[..., PluginHost]) -> Iterator[PluginHost]:
    """Pin a host with no plugins as the process-wide default for the test (``ORTModule(model)`` uses it)."""
    host = ortcore_host({})
    previous = set_host(host)
    yield host
    set_host(previous)


def _loss(outputs: Any) -> torch.Tensor:
    leaves = [t for t in pytree.tree_leaves(outputs) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return sum(t.float().square().mean() for t in leaves)


def assert_matches_torch(
    model: torch.nn.Module,
    args: tuple,
    kwargs: Mapping[str, Any] | None = None,
    *,
    host: PluginHost | None = None,
    loss_fn: Callable[[Any], torch.Tensor] = _loss,
    rtol: float = RTOL,
    atol: float = ATOL,
    **ortmodule_kwargs: Any,
) -> Any:
    """Run ``model`` in PyTorch and in ortcore from identical weights; compare outputs, loss and every gradient.

    Returns the ORTModule so a test can assert more (counters, saved graphs).
    """
    from .module import ORTModule

    kwargs = dict(kwargs or {})
    reference = copy.deepcopy(model)
    wrapped = ORTModule(model, host=host, **ortmodule_kwargs)
    expected = reference(*args, **kwargs)
    actual = wrapped(*args, **kwargs)
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, msg=lambda m: f"outputs differ: {m}")
    expected_loss, actual_loss = loss_fn(expected), loss_fn(actual)
    torch.testing.assert_close(actual_loss, expected_loss, rtol=rtol, atol=atol)
    expected_loss.backward()
    actual_loss.backward()
    assert_grads_match(wrapped, reference, rtol=rtol, atol=atol)
    return wrapped


def assert_grads_match(
    actual: torch.nn.Module, expected: torch.nn.Module, *, rtol: float = RTOL, atol: float = ATOL
) -> None:
    """Every parameter's gradient matches (and is None exactly where torch's is None)."""
    expected_params = dict(expected.named_parameters())
    for name, param in actual.named_parameters():
        ref = expected_params[name].grad
        if ref is None or param.grad is None:
            assert ref is None and param.grad is None, (
                f"{name}: grad is {param.grad is not None} in ortcore, {ref is not None} in torch"
            )
            continue
        torch.testing.assert_close(param.grad, ref, rtol=rtol, atol=atol, msg=lambda m, n=name: f"grad of {n}: {m}")


class ExecutedGraphs:
    """A plugin for tests: ORT writes the graph each session runs (after its own optimizations) to
    ``directory/executed_<n>.onnx``, one file per session made, probes included; :meth:`last` loads the newest.

    Register it with the plugins under test: ``make_host({"executed": ExecutedGraphs(tmp_path), ...})``."""

    def __init__(self, directory: Any):
        from pathlib import Path

        self.directory = Path(directory)
        self.sessions = 0

    @hookimpl
    def ortcore_session_plan(self, plan: Any) -> None:
        plan.set_session_options(self._write_to_file)

    def _write_to_file(self, session_options: Any) -> None:
        self.sessions += 1
        session_options.optimized_model_filepath = str(self.directory / f"executed_{self.sessions}.onnx")

    def last(self) -> Any:
        import onnx

        return onnx.load(str(self.directory / f"executed_{self.sessions}.onnx"))
