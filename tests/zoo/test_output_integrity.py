"""Every zoo model (every catalog of tests.zoo.catalogs): no tensor a call returned changes after the call.

Each model runs in its own process (``python -m tests.zoo.output_integrity``): two AdamW steps under ortcore beside
eager PyTorch, every returned tensor compared bitwise after ``backward()`` (none may change) and after
``optimizer.step()`` (only where eager's changed too: a returned parameter or buffer). The route is pytest's
``--exporter`` (default torchscript). A model that does not run in ORT at all is skipped with its error here
(``tests/zoo/test_zoo.py`` judges that); a model whose returned tensor changed fails, naming the output, when it
changed and by how much. Results go to ``$ORTCORE_ZOO_RESULTS/output_integrity/<catalog>`` when that is set.
Every model: ``python -m pytest -m exhaustive tests/zoo/test_output_integrity.py`` (about an hour on 2 cores); the
slow suite runs :data:`SAMPLE`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .catalogs import CATALOGS, models
from .harness import DEFAULT_TIMEOUT_S, EXPORTERS, REPO, check_exporter, child_env

ZOO = [(catalog, name) for catalog in CATALOGS for name in models(catalog)]
# The slow suite's share (every model is an hour on 2 cores: -m exhaustive): models whose outputs ORT computes in
# place or keeps for the backward (copied), the time-series transformers that returned an overwritten scale, and
# models whose outputs need no copy.
SAMPLE = {
    ("main", "bert"),
    ("main", "gpt2"),
    ("main", "t5"),
    ("main", "resnet18"),
    ("third", "time_series_transformer"),
    ("third", "informer"),
}
CASES = [
    pytest.param(catalog, name, id=f"{catalog}-{name}", marks=pytest.mark.slow if (catalog, name) in SAMPLE else ())
    for catalog, name in ZOO
]


@pytest.fixture(scope="session")
def integrity_results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    configured = os.environ.get("ORTCORE_ZOO_RESULTS")
    path = Path(configured) / "output_integrity" if configured else tmp_path_factory.mktemp("output_integrity")
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="session")
def integrity_route(request: pytest.FixtureRequest) -> str:
    return check_exporter(request.config.getoption("--exporter") or EXPORTERS[0])


@pytest.fixture(scope="session")
def torchvision_for_children() -> None:
    from .deps import ensure_torchvision

    ensure_torchvision()


@pytest.mark.exhaustive
@pytest.mark.parametrize(("catalog", "name"), CASES)
def test_no_returned_tensor_changes_after_the_call(
    catalog: str, name: str, integrity_results: Path, integrity_route: str, request: pytest.FixtureRequest
) -> None:
    if models(catalog)[name].family == "torchvision":
        request.getfixturevalue("torchvision_for_children")
    out_dir = integrity_results / catalog / integrity_route
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / f"{name}.json"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, "-X", "faulthandler", "-m", "tests.zoo.output_integrity", name, "--catalog", catalog]
    try:
        done = subprocess.run(
            [*cmd, "--json", str(out)],
            cwd=REPO,
            env=child_env(integrity_route),
            capture_output=True,
            text=True,
            timeout=DEFAULT_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        pytest.skip(f"{name}: no result after {DEFAULT_TIMEOUT_S:.0f} s (the zoo's own test judges timeouts)")
    if not out.is_file():
        pytest.skip(f"{name}: the child died ({done.returncode}): {done.stderr.strip()[-300:]}")
    result = json.loads(out.read_text())
    if result["status"] == "error":
        pytest.skip(f"{name} does not run in ORT on the {integrity_route} route: {result['error']}")
    changed = [
        f"{v['output']} {v['when']} on step {v['step']} (by up to {v['max_change']:.3g})" for v in result["violations"]
    ]
    assert result["status"] == "pass" and not changed, (
        f"{name}: returned tensors changed after the call: {'; '.join(changed)}; copied: {result['copied']}"
    )
