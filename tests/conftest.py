"""Shared test set-up: a clean ortcore environment and seeded RNGs per test, and the parity error report."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

import pytest

# isort: off
# Before torch, as a user's ``import ortcore`` comes first: it sets GOMP_SPINCOUNT, which libgomp reads when torch
# loads it (the ortcore.testing plugin, when pytest loaded it at start-up, imported ortcore first too).
import ortcore  # noqa: F401
import torch

# isort: on

sys.path.insert(0, os.path.dirname(__file__))  # so test files can `import models`
pytest.register_assert_rewrite("ortcore.testing")  # models imports it before pytest_plugins below loads it

import models  # noqa: E402

# ortcore's fixtures for plugin tests (ortcore_host): opt-in, so that installing ortcore changes no other project's
# pytest runs.
pytest_plugins = ["ortcore.testing"]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--parity-errors",
        action="store_true",
        default=False,
        help="print the largest ortcore-vs-torch differences each parity test observed",
    )
    parser.addoption(
        "--exporter",
        default=None,
        help="run every test with this exporter (sets ORTCORE_EXPORTER): torchscript (the default) or dynamo",
    )


@pytest.fixture(scope="session")
def gloo_world():
    """One gloo process group of one process for every test of the session that needs one (DeepSpeed, FSDP2),
    destroyed at its end: DeepSpeed keeps the groups it first sees in module globals, so a second group in one
    process breaks it. DeepSpeed starts it when installed (it then knows the group); torch otherwise."""
    import socket

    import torch.distributed as dist

    if dist.is_initialized():
        pytest.fail("a process group already exists: a test that made one did not destroy it")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.MonkeyPatch.context() as patch:
        ranks = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        for name, value in ranks.items():
            patch.setenv(name, value)
        try:
            import deepspeed
        except ImportError:
            dist.init_process_group("gloo")
        else:
            deepspeed.init_distributed(dist_backend="gloo", verbose=False)
        try:
            yield
        finally:
            dist.destroy_process_group()


@pytest.fixture(scope="session")
def deepspeed_world(gloo_world):
    """The session's gloo world, for DeepSpeed tests (skipped without DeepSpeed)."""
    pytest.importorskip("deepspeed")
    yield


_saved_cache_home: list[str | None] = []


def pytest_configure(config: pytest.Config) -> None:
    # Kernel choice (aten_fallback's torch_kernels = "auto") keeps its decisions in $XDG_CACHE_HOME/ortcore: for the
    # whole session, including fixtures of module scope and the processes tests start, a directory of the session's
    # own, never the user's ~/.cache.
    _saved_cache_home.append(os.environ.get("XDG_CACHE_HOME"))
    os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="ortcore-tests-cache-")


def pytest_unconfigure(config: pytest.Config) -> None:
    if not _saved_cache_home:
        return
    shutil.rmtree(os.environ.get("XDG_CACHE_HOME", ""), ignore_errors=True)
    saved = _saved_cache_home.pop()
    if saved is None:
        os.environ.pop("XDG_CACHE_HOME", None)
    else:
        os.environ["XDG_CACHE_HOME"] = saved


@pytest.fixture(autouse=True)
def _clean_ortcore_environment(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest):
    """No ORTMODULE_*/ORTCORE_* variable from the caller's shell changes a test, and every test starts from seed 0."""
    for name in list(os.environ):
        if name.startswith(("ORTMODULE_", "ORTCORE_")):
            monkeypatch.delenv(name)
    exporter = request.config.getoption("--exporter")
    if exporter:
        monkeypatch.setenv("ORTCORE_EXPORTER", exporter)
    # Kernel choice (torch_kernels = "auto") times nothing: every test's graph is the default list's, whatever machine
    # runs it (its file is the session's, pytest_configure). The tests of measuring (tests/plugins/
    # test_kernel_choice.py) turn it on with a file of their own.
    monkeypatch.setenv("ORTCORE_KERNEL_MEASURE", "off")
    torch.manual_seed(0)
    models.set_current_test(request.node.nodeid)
    yield
    models.set_current_test("<no test>")


@pytest.fixture
def all_dims_dynamic(monkeypatch: pytest.MonkeyPatch) -> None:
    """``dynamic_shapes = "always"``: every input dimension dynamic from the first export, one graph for all sizes
    (for tests of what a dynamic graph does; the default exports the first call's sizes, see test_state_machine)."""
    monkeypatch.setenv("ORTCORE_DYNAMIC_SHAPES", "always")


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    if not config.getoption("--parity-errors") or not models.MAX_ERRORS:
        return
    tr = terminalreporter
    tr.section("largest ortcore vs torch differences")
    tr.write_line(f"{'test':<72} {'quantity':<8} {'max abs':>10} {'max rel':>10} {'tol used':>9}")
    for test, quantities in models.MAX_ERRORS.items():
        name = test.split("::", 1)[-1]
        for quantity, err in quantities.items():
            tr.write_line(f"{name:<72} {quantity:<8} {err.abs:10.2e} {err.rel:10.2e} {err.tol_used:9.3f}")
