"""Every zoo model trains under ortcore (fallback disabled) with PyTorch's loss, gradients and AdamW loss curve.

Each model runs in its own process (``tests.zoo.run_model``): a crash or a timeout fails that model only. The route
is pytest's ``--exporter`` (default torchscript). On the default route every model must pass; on another route each
model's status must be the one ``docs/models.md`` shows for that route, so a model that breaks or starts to pass
fails the test until the page is regenerated (``python -m tests.zoo.report --exporter dynamo``). Results are written
as JSON to ``$ORTCORE_ZOO_RESULTS`` (default: a pytest temporary directory);
``python -m tests.zoo.report --exporter <route> --results DIR`` records them and rewrites the page.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from .catalog import MODELS
from .deps import ensure_torchvision
from .harness import EXPORTERS, check_exporter, describe_failure, run_model
from .report import DEFAULT_OUT, REGENERATE, documented_statuses

pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def zoo_results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Read before the autouse fixture clears ORTCORE_* variables for each test.
    configured = os.environ.get("ORTCORE_ZOO_RESULTS")
    path = Path(configured) if configured else tmp_path_factory.mktemp("zoo")
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="session")
def torchvision_ready() -> None:
    """Installs torchvision into .zoo-deps once, before any child process needs it (children would race)."""
    ensure_torchvision()


@pytest.fixture(scope="session")
def route(request: pytest.FixtureRequest) -> str:
    """The exporter the zoo runs on: pytest's ``--exporter``, else ortcore's default."""
    return check_exporter(request.config.getoption("--exporter") or EXPORTERS[0])


@pytest.fixture(scope="session")
def documented(route: str) -> dict[str, str]:
    """Per model, the status docs/models.md shows on ``route``."""
    statuses = documented_statuses(DEFAULT_OUT.read_text())
    if route not in statuses:
        pytest.fail(f"{DEFAULT_OUT.name} has no {route} column; regenerate it: {REGENERATE} --exporter {route}")
    return statuses[route]


@pytest.mark.parametrize("name", list(MODELS))
def test_model_trains_like_pytorch(name: str, zoo_results: Path, route: str, request: pytest.FixtureRequest) -> None:
    """Default route: the model passes. Other routes: its status is the one docs/models.md records for it."""
    if MODELS[name].family == "torchvision":
        request.getfixturevalue("torchvision_ready")
    result = run_model(name, zoo_results, exporter=route)
    if route == EXPORTERS[0]:
        assert result["status"] == "pass", f"{name}: {describe_failure(result)}"
        return
    expected = request.getfixturevalue("documented").get(name, "not run")
    change = "improved" if result["status"] == "pass" else "changed"
    assert result["status"] == expected, (
        f"{name} on the {route} route {change}: {DEFAULT_OUT.name} says {expected!r}, this run {result['status']!r} "
        f"({describe_failure(result)}); regenerate the page with `{REGENERATE} --exporter {route}` and commit it"
    )


def test_a_crashing_model_is_reported_with_its_signal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The harness turns a child killed by a signal into a 'crash' result naming the signal, and writes it."""
    import json

    from . import harness

    monkeypatch.setattr(
        harness.sys, "executable", str(_write_script(tmp_path, "import os, signal; os.kill(os.getpid(), 11)"))
    )
    result = harness.run_model("conv1d", tmp_path)
    assert result["status"] == "crash"
    assert "SIGSEGV" in result["error"]["first_line"]
    assert json.loads((tmp_path / "conv1d.json").read_text())["status"] == "crash"


def test_a_hanging_model_is_reported_as_timeout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from . import harness

    monkeypatch.setattr(harness.sys, "executable", str(_write_script(tmp_path, "import time; time.sleep(30)")))
    result = harness.run_model("conv1d", tmp_path, timeout=1)
    assert result["status"] == "timeout"
    assert "no result after 1 s" in result["error"]["first_line"]


def _write_script(tmp_path: Path, body: str) -> Path:
    """An executable standing in for the Python interpreter that ignores its arguments and runs ``body``."""
    import sys

    script = tmp_path / "fake_python"
    script.write_text(f"#!{sys.executable}\n{body}\n")
    script.chmod(0o755)
    return script
