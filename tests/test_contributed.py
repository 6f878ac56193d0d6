"""``ortcore.utils.data`` and ``ortcore.optim`` resolve names from plugins' hooks; errors name what is available."""

from __future__ import annotations

import subprocess
import sys

import pytest

import ortcore.utils.data as data
from ortcore.config import Config
from ortcore.contributed import declared_names
from ortcore.hookspecs import hookimpl
from ortcore.host import PluginHost, set_host


class BucketSampler:
    pass


class BucketPlugin:
    @hookimpl
    def ortcore_register(self, register):
        register.data_utility("BucketSampler", BucketSampler)


def _host(plugins):
    return PluginHost(Config.from_table({}, env={}), autoload=False, plugins=plugins)


def test_data_utilities_come_from_the_hook():
    host = _host({"buckets": BucketPlugin()})
    assert data.data_utilities(host) == {"BucketSampler": BucketSampler}
    previous = set_host(host)
    try:
        namespace: dict = {}
        exec("from ortcore.utils.data import BucketSampler", namespace)
        assert namespace["BucketSampler"] is BucketSampler
        assert "BucketSampler" in dir(data)
        with pytest.raises(
            AttributeError, match=r"no attribute 'Nope'; .* from installed plugins: \['BucketSampler'\]"
        ):
            data.Nope  # noqa: B018
    finally:
        set_host(previous)


def test_a_name_offered_by_two_plugins_is_an_error_naming_both():
    class Other:
        @hookimpl
        def ortcore_register(self, register):
            register.data_utility("BucketSampler", object)

    with pytest.raises(Exception, match=r"plugins '(buckets|other)' and '(buckets|other)' both offer a data utility"):
        _host({"buckets": BucketPlugin(), "other": Other()}).hooks.data_utilities()


def test_dunders_never_reach_the_plugins():
    with pytest.raises(AttributeError):
        data.__wrapped__  # noqa: B018


def test_declared_names_read_a_named_tuple_from_source(tmp_path, monkeypatch):
    (tmp_path / "some_plugin.py").write_text("DATA_UTILITIES = ('A', 'B')\nOPTIMIZERS = ('C',)\nraise SystemExit\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert declared_names("some_plugin", "DATA_UTILITIES") == ("A", "B")
    assert declared_names("some_plugin", "OPTIMIZERS") == ("C",)
    assert declared_names("some_plugin", "OTHER") == ()
    assert "some_plugin" not in sys.modules


def test_importing_ortcore_utils_data_imports_no_torch():
    code = "import sys, ortcore.utils.data; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0
