"""cuda_execution: CUDA provider options from the ORTMODULE_* variables; on CPU, reported once and harmless."""

from __future__ import annotations

import logging

import pytest
import torch

import ortcore_plugins.cuda_execution as plugin
from ortcore import ORTModule
from ortcore.api import LogLevel, SessionPlan
from ortcore.errors import OptionError
from ortcore.testing import assert_matches_torch, make_host


@pytest.fixture(autouse=True)
def _fresh_reports():
    plugin._reported.clear()


def _providers(options_env: dict[str, str], device: str) -> list:
    host = make_host({"cuda_execution": plugin}, env=options_env)
    providers = [("CUDAExecutionProvider", {"device_id": "0"}), ("CPUExecutionProvider", {})]
    if device == "cuda":
        # Only the option mapping is checked here; no GPU is needed for that.
        plan = SessionPlan(device=torch.device("cuda", 0), log_level=LogLevel.WARNING, providers=providers)
        host.hooks.session_plan(None, plan)
    return providers


def test_tuning_and_conv_search_become_cuda_provider_options():
    providers = _providers(
        {"ORTMODULE_ENABLE_TUNING": "1", "ORTMODULE_MAX_TUNING_DURATION_MS": "250", "ORTMODULE_CONV_ALGO_SEARCH": "exhaustive"},
        "cuda",
    )
    cuda = dict(providers)["CUDAExecutionProvider"]
    assert cuda == {
        "device_id": "0",
        "cudnn_conv_algo_search": "EXHAUSTIVE",
        "tunable_op_enable": "1",
        "tunable_op_tuning_enable": "1",
        "tunable_op_max_tuning_duration_ms": "250",
    }
    assert dict(providers)["CPUExecutionProvider"] == {}


def test_triton_on_a_build_without_it_is_an_error_naming_the_variable():
    with pytest.raises(OptionError, match="ORTMODULE_USE_TRITON=1: this onnxruntime build has no Triton"):
        _providers({"ORTMODULE_USE_TRITON": "1"}, "cuda")


def test_on_cpu_set_cuda_options_are_reported_once_and_training_matches_torch(caplog):
    caplog.set_level(logging.WARNING, logger="ortcore.cuda_execution")
    host = make_host({"cuda_execution": plugin}, env={"ORTMODULE_ENABLE_TUNING": "1"})
    assert_matches_torch(torch.nn.Linear(4, 2), (torch.randn(3, 4),), host=host)
    ORTModule(torch.nn.Linear(4, 2), host=host)(torch.randn(3, 4))
    reports = [r.getMessage() for r in caplog.records if r.name == "ortcore.cuda_execution"]
    assert len(reports) == 1
    assert "act only on a CUDA device and do nothing on cpu: enable_tuning (ORTMODULE_ENABLE_TUNING)" in reports[0]


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"ORTMODULE_CONV_ALGO_SEARCH": "FASTEST"}, r"ORTMODULE_CONV_ALGO_SEARCH='FASTEST'.*HEURISTIC, EXHAUSTIVE, DEFAULT"),
        ({"ORTMODULE_MAX_TUNING_DURATION_MS": "-5"}, r"ORTMODULE_MAX_TUNING_DURATION_MS='-5'.*integer >= 0"),
        ({"ORTMODULE_USE_FLASH_ATTENTION": "1"}, r"needs ORTMODULE_USE_TRITON=1"),
    ],
)
def test_bad_values_name_variable_and_allowed(env, message):
    with pytest.raises(OptionError, match=message):
        make_host({"cuda_execution": plugin}, env=env)


def test_a_variable_nothing_reads_is_reported_with_the_closest_name(caplog):
    caplog.set_level(logging.WARNING, logger="ortcore")
    make_host({"cuda_execution": plugin}, env={"ORTMODULE_ENABLE_TUNNING": "1"})
    assert "ORTMODULE_ENABLE_TUNNING is set but nothing reads it (did you mean ORTMODULE_ENABLE_TUNING?)" in caplog.text
