"""The pluggy markers of ortcore's hooks, in a module of their own that imports nothing of ortcore: the hook
specifications (:mod:`ortcore.hookspecs`) and every module implementing a hook, the core's own defaults included,
import them from here without importing one another."""

from __future__ import annotations

import pluggy

PROJECT = "ortcore"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)
