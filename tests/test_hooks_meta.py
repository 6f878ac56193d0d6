"""Every hook is specified, documented, called by the core and exercised by a test: the hook list cannot drift."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from ortcore import hookspecs

ROOT = Path(__file__).parents[1]
REFERENCE = ROOT / "docs" / "hooks.md"
FACADE = ROOT / "ortcore" / "host.py"
TESTS = Path(__file__).parent

SPECS = sorted(name for name in vars(hookspecs) if name.startswith("ortcore_"))

# Hooks exempt from the "exercised by a test" check while their tests are written (an entry must stay a real
# hookspec). Empty: every hook has a test.
NOT_YET_EXERCISED: frozenset[str] = frozenset()


def _reference_sections() -> dict[str, str]:
    """``{hook name: its section of docs/hooks.md}``, from the ``### `ortcore_x(...)` `` headings."""
    text = REFERENCE.read_text(encoding="utf-8")
    parts = re.split(r"^### `(ortcore_\w+)\(", text, flags=re.MULTILINE)
    return {parts[i]: parts[i + 1].split("\n## ")[0] for i in range(1, len(parts), 2)}


def test_hookspecs_exist_and_follow_the_naming_rule():
    assert len(SPECS) >= 15
    for name in SPECS:
        spec = getattr(hookspecs, name)
        assert callable(spec) and spec.__doc__, f"{name} has no docstring"
        assert hasattr(spec, "ortcore_spec"), f"{name} is named like a hook but is not a @hookspec"


def test_each_hookspec_docstring_is_one_line_and_its_prose_lives_in_the_reference():
    """The prose of a hook is written once, in docs/hooks.md; the spec's docstring is its one-line summary."""
    long = [name for name in SPECS if len(getattr(hookspecs, name).__doc__.strip().splitlines()) > 1]
    assert not long, f"hookspecs with more than a one-line docstring (move the prose to docs/hooks.md): {long}"


def test_every_hookspec_is_documented_with_arguments_timing_return_and_example():
    sections = _reference_sections()
    missing = [name for name in SPECS if name not in sections]
    assert not missing, f"hooks missing from docs/hooks.md: {missing}"
    for name in SPECS:
        section = sections[name]
        for part in ("**When:**", "**Arguments:**", "**Returns:**", "```python"):
            assert part in section, f"docs/hooks.md: the section of {name} has no {part}"
        for argument in getattr(hookspecs, name).__code__.co_varnames[: getattr(hookspecs, name).__code__.co_argcount]:
            assert f"`{argument}`" in section, f"docs/hooks.md: {name} does not describe its argument {argument!r}"
        assert f"def {name}(" in section, f"docs/hooks.md: the example of {name} does not implement it"


def test_reference_documents_no_hook_that_is_not_specified():
    stale = sorted(set(_reference_sections()) - set(SPECS))
    assert not stale, f"docs/hooks.md documents hooks that ortcore/hookspecs.py no longer declares: {stale}"


def test_reference_signatures_match_the_specs():
    text = REFERENCE.read_text(encoding="utf-8")
    for name in SPECS:
        code = getattr(hookspecs, name).__code__
        arguments = list(code.co_varnames[: code.co_argcount])
        heading = re.search(rf"^### `{name}\((.*)\) -> ", text, flags=re.MULTILINE)
        assert heading is not None, name
        documented = re.findall(r"(\w+)\s*:", heading.group(1))  # annotations hold no colon
        assert documented == arguments, f"docs/hooks.md: {name}({', '.join(documented)}) but the spec takes {arguments}"


def _implemented_in(name: str, text: str) -> bool:
    """A test implements the hook: a function or method of that name, a namespace attribute, or a ``specname``."""
    pattern = rf"\bdef\s+{name}\s*\(|\b{name}\s*=|specname\s*=\s*[\"']{name}[\"']"
    return re.search(pattern, text) is not None


def test_every_hookspec_is_exercised_by_a_test():
    texts = {p: p.read_text(encoding="utf-8") for p in TESTS.rglob("*.py") if p.resolve() != Path(__file__).resolve()}
    unexercised = [
        name
        for name in SPECS
        if name not in NOT_YET_EXERCISED and not any(_implemented_in(name, text) for text in texts.values())
    ]
    assert not unexercised, f"no test implements these hooks: {unexercised}"


def test_allow_list_names_only_real_hooks():
    assert NOT_YET_EXERCISED <= set(SPECS), f"not hookspecs: {sorted(NOT_YET_EXERCISED - set(SPECS))}"


def _facade_calls() -> set[str]:
    """Hook names the plugin host calls: ``<pm>.hook.ortcore_x(...)`` and the facade's ``_collect("ortcore_x")``."""
    called: set[str] = set()
    for node in ast.walk(ast.parse(FACADE.read_text(encoding="utf-8"))):
        if not isinstance(node, ast.Call):
            continue
        function = node.func
        if isinstance(function, ast.Attribute) and function.attr.startswith("ortcore_"):
            called.add(function.attr)
        # <pm>.hook.ortcore_x.get_hookimpls(): the implementations called one by one (ortcore_register)
        if isinstance(function, ast.Attribute) and isinstance(function.value, ast.Attribute):
            if function.value.attr.startswith("ortcore_") and function.attr == "get_hookimpls":
                called.add(function.value.attr)
        for argument in node.args[:1]:
            if isinstance(argument, ast.Constant) and isinstance(argument.value, str):
                called.add(argument.value)
    return called


@pytest.mark.parametrize("name", SPECS)
def test_hookspec_has_a_caller_in_the_core(name):
    assert name in _facade_calls(), f"ortcore/host.py never calls {name}: the core must call it through Hooks"


def test_core_calls_hooks_only_through_the_facade():
    """Outside the plugin host, the core reaches hooks through ``Hooks`` methods, never ``pm.hook`` directly."""
    offenders = []
    for path in sorted((ROOT / "ortcore").rglob("*.py")):
        if path in (FACADE, ROOT / "ortcore" / "hookspecs.py", ROOT / "ortcore" / "cli.py"):
            continue  # cli.py builds the command line from a plugin manager of its own (light command modules)
        text = path.read_text(encoding="utf-8")
        offenders += [f"{path.relative_to(ROOT)}: {m.group(0)}" for m in re.finditer(r"\.hook\.ortcore_\w+", text)]
    assert not offenders, offenders
