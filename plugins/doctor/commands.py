"""``ortcore doctor``: the doctor plugin's command (light: no torch at import; the checks import it)."""

from __future__ import annotations

import argparse

from ortcore.api import hookimpl


@hookimpl
def ortcore_commands(subparsers: argparse._SubParsersAction) -> None:
    _add_doctor(subparsers)


def _add_doctor(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "doctor",
        help="check versions, training bindings, environment and plugins; suggest a fix for each problem",
        description="Check the installation and run one training step of a tiny model against PyTorch.",
    )
    p.add_argument("--no-smoke", action="store_true", help="skip the one-step training check")
    p.set_defaults(run=_run_doctor)


def _run_doctor(args: argparse.Namespace) -> int:
    from ortcore.api import load_host

    from .checks import doctor, smoke_test

    host, error = load_host()
    findings = doctor(host, error)
    if not args.no_smoke and not any(f.level == "error" for f in findings):
        findings.append(smoke_test())
    marks = {"ok": "ok     ", "warning": "warning", "error": "ERROR  "}
    for f in findings:
        print(f"{marks[f.level]} {f.what}")
        if f.fix:
            print(f"        fix: {f.fix}")
    problems = sum(f.level != "ok" for f in findings)
    print(f"{problems} problem(s) found" if problems else "no problems found")
    return 1 if any(f.level == "error" for f in findings) else 0
