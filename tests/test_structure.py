"""The shape of the code base, read from the source with ``ast`` (nothing is imported):

* the core's modules (``ortcore/``), and the plugins' (``plugins/``), import one another without a cycle, counting
  every import (function-local and ``if TYPE_CHECKING:`` ones too);
* no plugin imports another (under ``plugins/`` or ``contrib/``, every import counted): what more than one plugin needs
  is a service of ``ortcore_plugins.services``, so that a plugin can be disabled or deleted without breaking another;
* no plugin reaches into a service: no private name (leading underscore) or private module of ``ortcore_plugins.services``
  (or of another plugin) is imported or read as an attribute;
* the core does not import plugins at module level, except the compatibility shims named in :data:`CORE_TO_PLUGIN`.

Each checker is also run on a small made-up tree, so that a checker that finds nothing is known to be able to.
"""

from __future__ import annotations

import ast
import graphlib
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CORE, CORE_PACKAGE = ROOT / "ortcore", "ortcore"
PLUGINS, PLUGINS_PACKAGE = ROOT / "plugins", "ortcore_plugins"

# Core modules allowed to import ortcore_plugins at module level, with the reason.
CORE_TO_PLUGIN = {
    "ortcore.hooks.divergence": "compatibility shim: the old import path of activation_stats' divergence tools",
    "ortcore.hooks.merge_activation_summary": "compatibility shim: the old import path of activation_stats' merge tool",
}


# -- reading modules -------------------------------------------------------------------------------------------------


def modules_of(root: Path, package: str) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` file under ``root`` (the directory of ``package``)."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join([package, *parts])] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def module_level_imports(tree: ast.Module) -> Iterator[ast.Import | ast.ImportFrom]:
    """Imports that run when the module is imported: its body, inside ``if``/``try``/``with`` blocks too, but not
    inside functions, classes or ``if TYPE_CHECKING:``."""
    stack: list[ast.stmt] = list(reversed(tree.body))
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        elif isinstance(node, ast.If):
            if not _is_type_checking(node.test):
                stack.extend(reversed(node.body))
            stack.extend(reversed(node.orelse))
        elif isinstance(node, ast.Try):
            for block in (node.body, *(h.body for h in node.handlers), node.orelse, node.finalbody):
                stack.extend(reversed(block))
        elif isinstance(node, ast.With):
            stack.extend(reversed(node.body))


def all_imports(tree: ast.Module) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import of a file, at any depth (a plugin's function-level import reaches into another plugin too)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node


def resolve_from(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The absolute module a ``from ... import`` statement of ``module`` imports from."""
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def imported(node: ast.Import | ast.ImportFrom, module: str, is_package: bool, known: set[str]) -> Iterator[str]:
    """The modules an import statement loads by name: a ``from pkg import x`` loads ``pkg.x`` if that is a module of
    ``known``, else ``pkg`` (``x`` is a name in it)."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            yield alias.name
        return
    source = resolve_from(node, module, is_package)
    for alias in node.names:
        candidate = f"{source}.{alias.name}"
        yield candidate if candidate in known else source


# -- (a) import cycles among the core's modules ----------------------------------------------------------------------


def import_graph(root: Path, package: str, *, every_import: bool = False) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports at module level (``every_import``: at any depth,
    function-local and ``if TYPE_CHECKING:`` imports too)."""
    files = modules_of(root, package)
    known = set(files)
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        is_package = path.name == "__init__.py"
        tree = ast.parse(path.read_text(), filename=str(path))
        statements = all_imports(tree) if every_import else module_level_imports(tree)
        targets = {t for node in statements for t in imported(node, module, is_package, known)}
        graph[module] = {t for t in targets if t in known and t != module}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of ``graph`` as the modules on it (the first repeated at the end), or None."""
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as e:
        return list(e.args[1])
    return None


@pytest.mark.parametrize("root, package", [(CORE, CORE_PACKAGE), (PLUGINS, PLUGINS_PACKAGE)], ids=["core", "plugins"])
def test_modules_import_one_another_without_a_cycle(root: Path, package: str) -> None:
    """No cycle, counting every import: a function-local or ``TYPE_CHECKING`` import is a dependency too (types live
    in the module below both)."""
    graph = import_graph(root, package, every_import=True)
    assert len(graph) > 20, f"the modules of {package} were not found"
    cycle = find_cycle(graph)
    assert cycle is None, f"import cycle among {package}'s modules: " + " -> ".join(cycle or [])


def test_the_cycle_finder_sees_function_local_and_type_checking_imports(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import b\n")
    (package / "b.py").write_text("def f():\n    from .a import g\n")
    assert find_cycle(import_graph(package, "pkg")) is None
    assert set(find_cycle(import_graph(package, "pkg", every_import=True)) or []) == {"pkg.a", "pkg.b"}


# -- (b) plugins import no other plugin, and only the services' public names -----------------------------------------

CONTRIB = ROOT / "contrib"
SERVICES = f"{PLUGINS_PACKAGE}.services"


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def plugin_of(module: str) -> str:
    """The plugin a module of ``ortcore_plugins`` belongs to: its first component (a module or a package)."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else module


def private_reaches(root: Path, package: str) -> list[str]:
    """Every place a module of ``package`` imports, or reads as an attribute, a private name or a private module of
    another plugin, as ``"<file>:<line>: <what>"``."""
    files = modules_of(root, package)
    known = set(files)
    found = []
    for module, path in files.items():
        is_package = path.name == "__init__.py"
        own = plugin_of(module)
        tree = ast.parse(path.read_text(), filename=str(path))
        where = f"{path.relative_to(root.parent)}"
        bound: dict[str, str] = {}  # local name -> plugin module of another plugin it stands for

        def other(target: str, own: str = own) -> bool:
            return target.split(".")[0] == package and target != package and plugin_of(target) != own

        for node in all_imports(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if other(alias.name) and any(_private(p) for p in alias.name.split(".")):
                        found.append(f"{where}:{node.lineno}: imports the private module {alias.name}")
                    elif other(alias.name) and alias.asname:
                        bound[alias.asname] = alias.name
                continue
            source = resolve_from(node, module, is_package)
            for alias in node.names:
                target = f"{source}.{alias.name}"
                if not other(target):
                    continue
                if any(_private(p) for p in target.split(".")):
                    kind = "private module" if target in known else "private name"
                    found.append(f"{where}:{node.lineno}: imports the {kind} {target}")
                elif target in known:
                    bound[alias.asname or alias.name] = target
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in bound
                and _private(node.attr)
            ):
                found.append(f"{where}:{node.lineno}: reads the private name {bound[node.value.id]}.{node.attr}")
    return sorted(found, key=lambda line: (line.split(":")[0], int(line.split(":")[1])))


def test_plugins_use_only_public_names_of_the_services() -> None:
    files = modules_of(PLUGINS, PLUGINS_PACKAGE)
    assert {"ortcore_plugins.services.aten_executor", "ortcore_plugins.aten_fallback"} <= set(files)
    reaches = private_reaches(PLUGINS, PLUGINS_PACKAGE)
    assert not reaches, "plugins reaching into the services (or other plugins):\n" + "\n".join(reaches)


def contrib_modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> file of every contributed plugin's code (``contrib/<project>/``; tests and build output
    left out, as :func:`ortcore_imports_outside_the_api` leaves them)."""
    found = {}
    for project in sorted(p for p in root.iterdir() if p.is_dir()):
        for path in sorted(project.rglob("*.py")):
            parts = list(path.relative_to(project).with_suffix("").parts)
            if {"__pycache__", "tests", "build"} & set(parts):
                continue
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def owning_plugin(module: str, packages: set[str]) -> str | None:
    """The plugin ``module`` is part of: a built-in's ``ortcore_plugins.<name>``, a contributed one's top package;
    None for a module of no plugin (torch, ortcore, the ``ortcore_plugins`` package itself)."""
    parts = module.split(".")
    if parts[0] == PLUGINS_PACKAGE:
        return ".".join(parts[:2]) if len(parts) > 1 else None
    return parts[0] if parts[0] in packages else None


def plugin_imports(files: dict[str, Path], repo: Path = ROOT) -> list[str]:
    """``"<file>:<line>: imports <module>"`` for every import, at any depth (function-local and ``TYPE_CHECKING``
    ones too), by a module of ``files`` of a module of another plugin, the services (:data:`SERVICES`) excepted."""
    packages = {m.split(".")[0] for m in files} - {PLUGINS_PACKAGE}
    known = set(files)
    found = []
    for module, path in files.items():
        own = owning_plugin(module, packages)
        is_package = path.name == "__init__.py"
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in all_imports(tree):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                source = resolve_from(node, module, is_package)
                # A name imported from the package of the built-ins is a plugin (module or package) of it.
                targets = [
                    f"{source}.{alias.name}"
                    if f"{source}.{alias.name}" in known or source == PLUGINS_PACKAGE
                    else source
                    for alias in node.names
                ]
            for target in dict.fromkeys(targets):
                other = owning_plugin(target, packages)
                if other is not None and other not in (own, SERVICES):
                    found.append(f"{path.relative_to(repo)}:{node.lineno}: imports {target}")
    return found


def test_no_plugin_imports_another_plugin() -> None:
    """Only ``ortcore.api`` and the services are shared: a plugin importing another would break when that one is
    disabled, and ties the two together (what both need belongs in ``ortcore_plugins.services``)."""
    files = {**modules_of(PLUGINS, PLUGINS_PACKAGE), **contrib_modules(CONTRIB)}
    assert {"ortcore_plugins.op_routing", "ortcore_plugins.aten_fallback", "ortcore_nan_guard"} <= set(files)
    found = plugin_imports(files)
    assert not found, "plugins importing other plugins (move what they share to ortcore_plugins.services):\n" + (
        "\n".join(found)
    )


def test_shared_services_are_public_modules_each_documented_in_the_package() -> None:
    services = [m for m in modules_of(PLUGINS, PLUGINS_PACKAGE) if m.startswith("ortcore_plugins.services.")]
    assert {"ortcore_plugins.services.aten_executor", "ortcore_plugins.services.python_op"} <= set(services)
    docstring = ast.get_docstring(ast.parse((PLUGINS / "services" / "__init__.py").read_text())) or ""
    for module in services:
        name = module.rpartition(".")[2]
        assert not _private(name), f"{module}: a service is public, so its module name has no leading underscore"
        assert f"``{name}``" in docstring, f"ortcore_plugins.services' docstring does not describe {name}"


# -- (c) the core does not import plugins ----------------------------------------------------------------------------


def core_imports_of_plugins(root: Path, package: str, plugins_package: str) -> dict[str, list[str]]:
    """Core module -> the ``plugins_package`` modules it imports at module level."""
    result = {}
    for module, path in modules_of(root, package).items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"
        targets = sorted(
            {
                t
                for node in module_level_imports(tree)
                for t in imported(node, module, is_package, set())
                if t.split(".")[0] == plugins_package
            }
        )
        if targets:
            result[module] = targets
    return result


def test_core_imports_no_plugin_at_module_level_but_its_compatibility_shims() -> None:
    found = core_imports_of_plugins(CORE, CORE_PACKAGE, PLUGINS_PACKAGE)
    unexpected = {m: t for m, t in found.items() if m not in CORE_TO_PLUGIN}
    assert not unexpected, f"core modules importing plugins at module level: {unexpected}"
    stale = set(CORE_TO_PLUGIN) - set(found)
    assert not stale, f"allowed core-to-plugin imports that no longer exist (drop them from CORE_TO_PLUGIN): {stale}"


# -- the checkers find what they look for ------------------------------------------------------------------------------


def write_tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_cycle_check_names_the_modules_of_a_cycle(tmp_path: Path) -> None:
    root = write_tree(
        tmp_path / "core",
        {
            "__init__.py": "",
            "a.py": "from .b import x\n",
            "b.py": "from . import c\nx = 1\n",
            "c.py": "import core.a\n",
            "d.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import y\n\ndef f():\n    from . import a\n",
        },
    )
    graph = import_graph(root, "core")
    assert graph["core.d"] == set()  # TYPE_CHECKING and function-level imports do not run at import
    cycle = find_cycle(graph)
    assert cycle is not None and set(cycle) == {"core.a", "core.b", "core.c"} and cycle[0] == cycle[-1]
    del graph["core.c"]
    assert find_cycle(graph) is None


@pytest.mark.parametrize(
    ("source", "what"),
    [
        ("from ortcore_plugins.beta import _helper\n", "private name ortcore_plugins.beta._helper"),
        ("from .beta import _helper\n", "private name ortcore_plugins.beta._helper"),
        ("from . import _gamma\n", "private module ortcore_plugins._gamma"),
        ("import ortcore_plugins._gamma as g\n", "private module ortcore_plugins._gamma"),
        ("import ortcore_plugins.beta as b\nb._helper()\n", "private name ortcore_plugins.beta._helper"),
        ("from . import beta\n\ndef f():\n    return beta._helper\n", "private name ortcore_plugins.beta._helper"),
        ("from .shared import tools\ntools._cache.clear()\n", "private name ortcore_plugins.shared.tools._cache"),
    ],
)
def test_private_reach_check_finds_each_form(tmp_path: Path, source: str, what: str) -> None:
    root = write_tree(
        tmp_path / "plugins",
        {
            "__init__.py": "",
            "alpha.py": source,
            "beta.py": "def _helper(): ...\n",
            "_gamma.py": "",
            "shared/__init__.py": "",
            "shared/tools.py": "_cache = {}\n",
        },
    )
    reaches = private_reaches(root, "ortcore_plugins")
    assert len(reaches) == 1 and what in reaches[0] and reaches[0].startswith("plugins/alpha.py:"), reaches


@pytest.mark.parametrize(
    "source",
    [
        "from ortcore_plugins.beta import helper\n",
        "from ortcore_plugins import beta\n",
        "import ortcore_plugins.beta.inner as inner\n",
        "from ..beta import helper\n",
        "from ..beta.inner import x\n",
        "def f():\n    from ortcore_plugins.beta import helper\n",
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ortcore_plugins.beta import helper\n",
        "import contributed\n",
    ],
    ids=[
        "from",
        "from-package",
        "import-as",
        "relative",
        "relative-module",
        "function-local",
        "type-checking",
        "contrib",
    ],
)
def test_plugin_import_check_finds_each_form(tmp_path: Path, source: str) -> None:
    tree = write_tree(
        tmp_path / "plugins",
        {
            "__init__.py": "",
            "alpha/__init__.py": "from . import own\nfrom .own import y\n",
            "alpha/own.py": "from ortcore_plugins.services import tool\nfrom ..services.tool import z\nimport torch\n",
            "alpha/uses.py": source,
            "beta/__init__.py": "helper = 1\n",
            "beta/inner.py": "x = 1\n",
            "services/__init__.py": "",
            "services/tool.py": "z = 1\n",
        },
    )
    contributed = write_tree(
        tmp_path / "contrib" / "contributed", {"contributed.py": "import ortcore_plugins.services.tool\n"}
    )
    files = {**modules_of(tree, "ortcore_plugins"), **contrib_modules(contributed.parent)}
    found = plugin_imports(files, tmp_path)
    assert len(found) == 1 and found[0].startswith("plugins/alpha/uses.py:"), found


def test_plugin_import_check_finds_a_contributed_plugin_importing_a_built_in_or_a_service_importing_a_plugin(
    tmp_path: Path,
) -> None:
    tree = write_tree(
        tmp_path / "plugins",
        {"__init__.py": "", "beta.py": "", "services/__init__.py": "", "services/tool.py": "from .. import beta\n"},
    )
    write_tree(tmp_path / "contrib" / "ortcore-x", {"x/__init__.py": "from ortcore_plugins.beta import y\n"})
    write_tree(tmp_path / "contrib" / "ortcore-x" / "tests", {"test_x.py": "import ortcore_plugins.beta\n"})
    files = {**modules_of(tree, "ortcore_plugins"), **contrib_modules(tmp_path / "contrib")}
    assert sorted(plugin_imports(files, tmp_path)) == [
        "contrib/ortcore-x/x/__init__.py:1: imports ortcore_plugins.beta",
        "plugins/services/tool.py:1: imports ortcore_plugins.beta",
    ]


def test_private_reach_check_allows_a_plugins_own_private_names(tmp_path: Path) -> None:
    root = write_tree(
        tmp_path / "plugins",
        {
            "__init__.py": "",
            "alpha/__init__.py": "from . import _impl\nfrom ._impl import _x\n_impl._y\n",
            "alpha/_impl.py": "_x = _y = 1\n",
            "beta.py": "from ortcore_plugins.alpha import public\nimport ortcore_plugins.alpha as a\na.__name__\n",
        },
    )
    assert private_reaches(root, "ortcore_plugins") == []


def test_core_to_plugin_check_finds_module_level_imports_only(tmp_path: Path) -> None:
    root = write_tree(
        tmp_path / "core",
        {
            "__init__.py": "",
            "a.py": "import ortcore_plugins.x\n",
            "b.py": "def f():\n    import ortcore_plugins.x\n",
            "c.py": "from ortcore_plugins.y import z\n",
        },
    )
    found = core_imports_of_plugins(root, "core", "ortcore_plugins")
    assert found == {"core.a": ["ortcore_plugins.x"], "core.c": ["ortcore_plugins.y"]}


def test_importing_ortcore_keeps_onnxruntime_from_importing_upstreams_ortmodule() -> None:
    """onnxruntime's package check imports upstream's ORTModule (sympy and all, about 0.6 s, then fails on this
    torch); after ``import ortcore`` it meets a stub that fails at once, and ortcore still trains."""
    import subprocess
    import sys

    code = (
        "import torch, ortcore, sys\n"
        "model = ortcore.ORTModule(torch.nn.Linear(3, 2))\n"
        "model(torch.ones(4, 3)).sum().backward()\n"
        "assert model.state_machine.counters.fallbacks == 0\n"
        "loaded = sorted(m for m in sys.modules if m.startswith('onnxruntime.training.ortmodule.'))\n"
        "assert not loaded, loaded\n"
        "assert 'sympy' not in sys.modules\n"
        "try:\n"
        "    from onnxruntime.training.ortmodule import ORTModule\n"
        "except ImportError:\n"
        "    pass\n"
        "else:\n"
        "    raise AssertionError('upstream ORTModule imported')\n"
        "stub = sys.modules['onnxruntime.training.ortmodule']\n"  # module scanners (torch.compile's pickler)
        "assert not hasattr(stub, 'anything')\n"
        "try:\n"
        "    stub.ORTModule\n"
        "except AttributeError as e:\n"
        "    assert 'ortcore.ORTModule' in str(e), e\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


# -- the plugin API --------------------------------------------------------------------------------------------------

# What plugin code may still import from ortcore outside ``ortcore.api`` (file: name -> why). Empty: every import
# goes through the API; an entry added here needs a reason, and one that stops being imported must leave.
KNOWN_INTERNAL: dict[str, str] = {}


def ortcore_imports_outside_the_api(root: Path, repo: Path = ROOT) -> list[str]:
    """``"<file>: <module>.<name>"`` for every import of ortcore other than ``ortcore.api`` in plugin code under
    ``root`` (any depth: module level, in functions, under ``TYPE_CHECKING``); tests (``tests/`` folders) may use
    ortcore's user surface too and are left out."""
    found = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if "__pycache__" in parts or "tests" in parts or "build" in parts:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                if node.module == "ortcore" or (node.module.startswith("ortcore.") and node.module != "ortcore.api"):
                    found += [f"{path.relative_to(repo)}: {node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                found += [
                    f"{path.relative_to(repo)}: {a.name}"
                    for a in node.names
                    if a.name == "ortcore" or (a.name.startswith("ortcore.") and a.name != "ortcore.api")
                ]
    return found


def test_plugins_import_ortcore_only_through_its_api() -> None:
    found = ortcore_imports_outside_the_api(PLUGINS) + ortcore_imports_outside_the_api(CONTRIB)
    new = sorted(set(found) - set(KNOWN_INTERNAL))
    assert not new, "plugin code imports ortcore outside ortcore.api (add the name to ortcore.api):\n" + "\n".join(new)
    gone = sorted(set(KNOWN_INTERNAL) - set(found))
    assert not gone, "no longer imported: remove from KNOWN_INTERNAL:\n" + "\n".join(gone)


# What makes or changes an ONNX Runtime session or graph build: only the core calls these (plugins ask the core for a
# measurement or probe session, ortcore.api.measurement_session / probe_session, which it counts).
SESSION_MAKERS = frozenset(
    {"InferenceSession", "TrainingAgent", "OrtModuleGraphBuilder", "TrainingSession", "SessionOptions", "build_graph"}
)


def sessions_made(folder: Path, repo: Path = ROOT) -> list[str]:
    """``path: name`` of each call of a session maker in ``folder`` (tests excepted)."""
    found = []
    for path in sorted(folder.rglob("*.py")):
        if "tests" in path.relative_to(folder).parts or "build" in path.relative_to(folder).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call):
                function = node.func
                name = function.attr if isinstance(function, ast.Attribute) else getattr(function, "id", None)
                if name in SESSION_MAKERS:
                    found.append(f"{path.relative_to(repo)}: {name}")
    return found


def test_no_plugin_creates_or_edits_a_session() -> None:
    found = sessions_made(PLUGINS) + sessions_made(CONTRIB)
    assert not found, "plugins make sessions themselves (ask ortcore.api.probe_session or measurement_session):\n" + (
        "\n".join(found)
    )


def test_session_check_finds_each_form(tmp_path: Path) -> None:
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "a.py").write_text(
        "import onnxruntime as ort\nfrom onnxruntime.capi import _pybind_state as C\n"
        "def f(m):\n    ort.InferenceSession(m)\n    C.TrainingAgent(m)\n    SessionOptions()\n"
    )
    assert sessions_made(tmp_path / "p", tmp_path) == [
        "p/a.py: InferenceSession",
        "p/a.py: TrainingAgent",
        "p/a.py: SessionOptions",
    ]


def test_api_check_finds_each_form(tmp_path: Path) -> None:
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "a.py").write_text(
        "from ortcore.api import hookimpl\nimport ortcore.session\n"
        "def f():\n    from ortcore.exporter import _SYMBOLICS\n"
    )
    (tmp_path / "p" / "tests").mkdir()
    (tmp_path / "p" / "tests" / "test_a.py").write_text("from ortcore import ORTModule\n")
    assert ortcore_imports_outside_the_api(tmp_path / "p", tmp_path) == [
        "p/a.py: ortcore.session",
        "p/a.py: ortcore.exporter._SYMBOLICS",
    ]


def test_every_api_name_resolves_without_importing_torch() -> None:
    import subprocess
    import sys

    code = (
        "import sys, ortcore.api as api; assert 'torch' not in sys.modules, 'importing ortcore.api imported torch'; "
        "[getattr(api, n) for n in api.__all__]; print(len(api.__all__))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert int(done.stdout.strip()) >= 50


# -- drawing the import graph ------------------------------------------------------------------------------------------


def import_graph_dot(which: str) -> str:
    """The import graph of ``which`` (``core`` or ``plugins``) in Graphviz's DOT language, every import counted as
    the cycle test counts them (function-local and ``TYPE_CHECKING`` ones too)."""
    root, package = {"core": (CORE, CORE_PACKAGE), "plugins": (PLUGINS, PLUGINS_PACKAGE)}[which]
    graph = import_graph(root, package, every_import=True)
    lines = [f'digraph "{package}" {{', "  rankdir=LR;"]
    for module in sorted(graph):
        lines.append(f'  "{module}";')
        lines += [f'  "{module}" -> "{target}";' for target in sorted(graph[module])]
    return "\n".join([*lines, "}"]) + "\n"


def test_the_import_graph_can_be_drawn() -> None:
    dot = import_graph_dot("core")
    assert dot.startswith('digraph "ortcore"') and '"ortcore.module" -> "ortcore.pipeline";' in dot


if __name__ == "__main__":
    # python -m tests.test_structure core | dot -Tsvg > core.svg  (or plugins)
    print(import_graph_dot(sys.argv[1] if len(sys.argv) > 1 else "core"), end="")
