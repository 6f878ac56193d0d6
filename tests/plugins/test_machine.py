"""Every speed number names its machine: the machine service, the bench table and plot title, the doctor."""

from __future__ import annotations

from pathlib import Path

import pytest

from ortcore_plugins.bench import suite as bench
from ortcore_plugins.services import machine

ZEN4 = """processor	: 0
vendor_id	: AuthenticAMD
cpu family	: 25
model		: 17
model name	: AMD EPYC
flags		: fpu sse sse2 avx fma avx2 avx512f avx512dq avx512cd avx512bw avx512vl avx512_bf16

processor	: 1
model name	: something else
"""


@pytest.mark.parametrize(
    "flags, level",
    [
        ("sse sse2", "baseline"),
        ("sse2 avx", "AVX"),
        ("avx avx2", "AVX"),  # AVX2 without FMA3 is not MLAS's FMA3 path
        ("avx avx2 fma", "AVX2"),
        ("avx avx2 fma avx512f", "AVX2"),  # AVX-512 foundation alone: not the level torch or MLAS call AVX-512
        ("avx avx2 fma avx512f avx512bw avx512vl", "AVX-512"),
        ("avx avx2 fma avx512f avx512bw avx512vl amx_tile amx_bf16", "AMX"),
    ],
)
def test_isa_level_is_the_best_level_all_of_whose_flags_the_cpu_has(flags: str, level: str) -> None:
    assert machine.isa_level(set(flags.split())) == level


def test_a_virtual_machines_bare_cpu_name_gets_its_family_and_model(tmp_path: Path) -> None:
    path = tmp_path / "cpuinfo"
    path.write_text(ZEN4)
    found = machine.describe_machine(path)
    assert found["cpu"] == "AMD EPYC (family 25, model 17)"
    assert found["isa"] == "AVX-512"
    assert found["ort_gemm"] == "MLAS, AVX-512F float32 kernel"
    line = machine.machine_line(found)
    assert line.startswith("AMD EPYC (family 25, model 17), ") and "AVX-512" in line and "ORT MLAS" in line


def test_without_cpuinfo_the_isa_is_unknown_not_guessed(tmp_path: Path) -> None:
    found = machine.describe_machine(tmp_path / "missing")
    assert found["isa"] == "unknown" and found["cores"] and found["cpu"]


def _report(environment: dict) -> bench.BenchReport:
    result = bench.RunResult(
        model="bert", mode="eager", ok=True, first_step_s=1.0, steady_step_s=0.1, step_times_s=[1.0, 0.1],
        losses=[2.0, 1.9], final_loss=1.9, rss_baseline_mib=400.0, rss_peak_mib=500.0,
        rss_peak_above_baseline_mib=100.0, environment=environment,
    )  # fmt: skip
    return bench.BenchReport(bench.preset("quick"), [result], {"GOMP_SPINCOUNT": "10000"}, 1.0, name="quick")


def test_the_bench_table_names_the_machine_its_runs_recorded(tmp_path: Path) -> None:
    from rich.console import Console

    path = tmp_path / "cpuinfo"
    path.write_text(ZEN4)
    hardware = machine.describe_machine(path)
    console = Console(width=400, record=True)
    console.print(bench.results_table(_report({"hardware": hardware})))
    text = " ".join(console.export_text().split())  # the title wraps at the table's width
    assert f"ortcore bench on {machine.machine_line(hardware)}" in text
    console = Console(width=400, record=True)
    console.print(bench.results_table(_report({})))  # a file from before runs recorded it: not this machine's name
    assert bench.NO_MACHINE in " ".join(console.export_text().split())


def test_each_run_records_the_machine_it_ran_on() -> None:
    pytest.importorskip("transformers")
    assert bench._environment()["hardware"] == machine.describe_machine()


def test_doctor_names_the_machine() -> None:
    from ortcore.testing import make_host
    from ortcore_plugins.doctor.checks import doctor

    host = make_host({})
    try:
        findings = doctor(host)
    finally:
        host.close()
    lines = [f.what for f in findings if f.what.startswith("machine: ")]
    assert lines == [f"machine: {machine.machine_line(machine.describe_machine())}"]
