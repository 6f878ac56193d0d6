"""Every zoo model trains under ortcore (fallback disabled) with PyTorch's loss, gradients and AdamW loss curve.

Parametrized by catalog (``main``, ``wide``; test ids ``main-bert``, ``wide-swin``: ``-k wide`` runs the wide zoo).
Each model runs in its own process (``tests.zoo.run_model``): a crash or a timeout fails that model only. The route
is pytest's ``--exporter`` (default torchscript). In the main zoo on the default route every model must pass; on
another route each model's status must be the one ``docs/models.md`` shows for that route. In the wide zoo each
model's status must be the one its record (``tests/zoo/records/wide/<route>.json``, rendered in the page's wide
section) holds. Either way a model that breaks or starts to pass fails the test until the record is regenerated
(``python -m tests.zoo.report [--catalog wide] --exporter <route>``). A model with PyTorch's gradients that feeds
more than half of its parameters to PythonOps (a region routed to PyTorch is one node however much it holds), or,
with repairs in force, runs less than half of its training graph's nodes on ORT's kernels, has the status
``pytorch``, not ``pass`` (``run_model.MIN_ORT_SHARE``): in the main zoo that fails the test, in the wide zoo its
record says so.
Results are written as JSON to ``$ORTCORE_ZOO_RESULTS/<catalog>`` (default: a pytest temporary directory);
``python -m tests.zoo.report [--catalog wide] --exporter <route> --results DIR`` records them and rewrites the page.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from .catalogs import CATALOGS, DEFAULT_CATALOG, models
from .deps import ensure_torchvision
from .harness import EXPORTERS, check_exporter, describe_failure, run_model
from .report import DEFAULT_OUT, REGENERATE, documented_statuses, load_records

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


def recorded_statuses(catalog: str, route: str) -> dict[str, str] | None:
    """Per model, the status ``catalog``'s record of ``route`` holds; None when that route has no record."""
    record = load_records(catalog=catalog).get(route)
    return {name: row["status"] for name, row in record["models"].items()} if record else None


ZOO = [(catalog, name) for catalog in CATALOGS for name in models(catalog)]


@pytest.mark.parametrize(("catalog", "name"), ZOO, ids=[f"{c}-{n}" for c, n in ZOO])
def test_model_trains_like_pytorch(
    catalog: str, name: str, zoo_results: Path, route: str, request: pytest.FixtureRequest
) -> None:
    """Main zoo, default route: the model passes. Otherwise: its status is the one recorded for it. A passing model
    runs mostly in ORT."""
    if catalog == DEFAULT_CATALOG and route != EXPORTERS[0]:
        expected = request.getfixturevalue("documented").get(name, "not run")
        where = DEFAULT_OUT.name
    elif catalog != DEFAULT_CATALOG:
        statuses = recorded_statuses(catalog, route)
        if statuses is None:
            pytest.skip(
                f"the {catalog} zoo has no record of the {route} route: `{REGENERATE} --catalog {catalog} "
                f"--exporter {route}` makes one"
            )
        expected = statuses.get(name, "not run")
        where = f"the {catalog} zoo's record"
    else:
        expected, where = "pass", ""
    if models(catalog)[name].family == "torchvision":
        request.getfixturevalue("torchvision_ready")
    out_dir = zoo_results / catalog
    out_dir.mkdir(exist_ok=True)
    result = run_model(name, out_dir, exporter=route, catalog=catalog)
    if not where:
        assert result["status"] == "pass", f"{name}: {describe_failure(result)}"
    else:
        change = "improved" if result["status"] == "pass" else "changed"
        regenerate = f"{REGENERATE}{'' if catalog == DEFAULT_CATALOG else ' --catalog ' + catalog} --exporter {route}"
        assert result["status"] == expected, (
            f"{name} on the {route} route {change}: {where} says {expected!r}, this run {result['status']!r} "
            f"({describe_failure(result)}); regenerate the page with `{regenerate}` and commit it"
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
