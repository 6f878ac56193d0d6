"""User-facing options: log levels, fallback policy, debug options and the runtime options read from env vars.

Every value a user can write (an argument or an ``ORTMODULE_*`` variable) is parsed here, and a bad one raises
:class:`OptionError` naming the value, where it came from and what is allowed.
"""

from __future__ import annotations

import difflib
import enum
import logging
import os
from collections.abc import Mapping

import attrs

from .errors import OptionError


def _suggest(value: str, allowed: list[str]) -> str:
    close = difflib.get_close_matches(str(value).upper(), allowed, n=1)
    return f" Did you mean {close[0]!r}?" if close else ""


class LogLevel(enum.IntEnum):
    """Log levels with the seeds' meaning; WARNING (the default) keeps exporter noise out, VERBOSE shows all."""

    VERBOSE = 0
    DEVINFO = 1
    INFO = 2
    WARNING = 3
    ERROR = 4
    FATAL = 5

    @classmethod
    def parse(cls, value: object, source: str = "log_level") -> LogLevel:
        """Accept a LogLevel, its name (any case) or its integer value."""
        if isinstance(value, cls):
            return value
        if isinstance(value, int) and not isinstance(value, bool) and value in cls._value2member_map_:
            return cls(value)
        if isinstance(value, str):
            text = value.strip().upper()
            if text in cls.__members__:
                return cls[text]
            if text.isdigit() and int(text) in cls._value2member_map_:
                return cls(int(text))
        allowed = list(cls.__members__)
        raise OptionError(
            f"{source}={value!r} is not a log level; allowed: {', '.join(allowed)} (or 0-5).{_suggest(value, allowed)}"
        )

    @property
    def python_level(self) -> int:
        """The :mod:`logging` level that ortcore's logger uses at this log level."""
        return {0: 5, 1: 15, 2: logging.INFO, 3: logging.WARNING, 4: logging.ERROR, 5: logging.CRITICAL}[self.value]

    @property
    def ort_severity(self) -> int:
        """ONNX Runtime's severity (0 verbose ... 4 fatal) for this level, as the seeds' table gives it."""
        return {0: 0, 1: 1, 2: 2, 3: 2, 4: 3, 5: 4}[self.value]


logging.addLevelName(5, "VERBOSE")
logging.addLevelName(15, "DEVINFO")


class FallbackPolicy(enum.IntFlag):
    """When ORT cannot run the model, which failures fall back to PyTorch (flags combine with ``|``)."""

    FALLBACK_DISABLE = 1
    FALLBACK_FORCE_TORCH_FORWARD = 2
    FALLBACK_FORCE_TORCH_BACKWARD = 4
    FALLBACK_UNSUPPORTED_DEVICE = 8
    FALLBACK_UNSUPPORTED_DATA = 16
    FALLBACK_UNSUPPORTED_TORCH_MODEL = 32
    FALLBACK_UNSUPPORTED_ONNX_MODEL = 64
    FALLBACK_BAD_INITIALIZATION = 128

    @classmethod
    def default(cls) -> FallbackPolicy:
        return (
            cls.FALLBACK_UNSUPPORTED_DEVICE
            | cls.FALLBACK_UNSUPPORTED_DATA
            | cls.FALLBACK_UNSUPPORTED_TORCH_MODEL
            | cls.FALLBACK_UNSUPPORTED_ONNX_MODEL
        )

    @classmethod
    def parse(cls, value: object, source: str = "fallback_policy") -> FallbackPolicy:
        """Accept a FallbackPolicy, an int, or names joined by ``|`` (``FALLBACK_`` prefix optional)."""
        if isinstance(value, cls):
            return value
        if isinstance(value, int) and not isinstance(value, bool) and 0 < value < 256:
            return cls(value)
        if isinstance(value, str) and value.strip():
            policy = cls(0)
            allowed = list(cls.__members__)
            for part in value.split("|"):
                name = part.strip().upper()
                if not name.startswith("FALLBACK_"):
                    name = "FALLBACK_" + name
                if name not in cls.__members__:
                    raise OptionError(
                        f"{source}={value!r}: {part.strip()!r} is not a fallback policy; allowed: "
                        f"{', '.join(allowed)}, joined with '|'.{_suggest(name, allowed)}"
                    )
                policy |= cls[name]
            return policy
        raise OptionError(f"{source}={value!r} is not a fallback policy; allowed: {', '.join(cls.__members__)}")

    def allows(self, flag: FallbackPolicy) -> bool:
        """Whether a failure of kind ``flag`` falls back (never when FALLBACK_DISABLE is set)."""
        return FallbackPolicy.FALLBACK_DISABLE not in self and flag in self


def _parse_bool(value: object, source: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise OptionError(f"{source}={value!r} is not a boolean; allowed: 1/0, true/false, yes/no, on/off")


def _parse_opset(value: object, source: str) -> int:
    try:
        opset = int(str(value).strip()) if not isinstance(value, bool) else None
    except ValueError:
        opset = None
    if opset is None or not 14 <= opset <= 20:
        raise OptionError(f"{source}={value!r} is not a supported ONNX opset; allowed: an integer from 14 to 20")
    return opset


@attrs.frozen
class DebugOptions:
    """Debugging switches: what to log and whether to save the ONNX graphs.

    Example::

        ORTModule(model, DebugOptions(save_onnx=True, log_level=LogLevel.INFO, onnx_prefix="bert"))

    ``ORTMODULE_LOG_LEVEL`` overrides ``log_level``; ``ORTMODULE_SAVE_ONNX_PATH`` sets the directory (default: the
    working directory) in which ``<prefix>_exported_<mode>.onnx``, ``<prefix>_pre_grad_<mode>.onnx`` and
    ``<prefix>_training.onnx`` (or ``_inference.onnx``) are written.
    """

    log_level: LogLevel = attrs.field(default=LogLevel.WARNING, converter=LogLevel.parse)
    save_onnx: bool = attrs.field(default=False, converter=lambda v: _parse_bool(v, "save_onnx"))
    onnx_prefix: str = attrs.field(default="")
    save_path: str = attrs.field(default="")

    @onnx_prefix.validator
    def _check_prefix(self, _attribute: attrs.Attribute, value: str) -> None:
        if not isinstance(value, str):
            raise OptionError(f"onnx_prefix={value!r} must be a string")
        if self.save_onnx and not value.strip():
            raise OptionError("onnx_prefix='' : save_onnx=True needs a non-empty onnx_prefix to name the saved files")


ENV_PREFIX = "ORTMODULE_"


@attrs.frozen
class RuntimeOptions:
    """The core's effective options: DebugOptions and ORTModule arguments, overridden by ``ORTMODULE_*`` variables."""

    log_level: LogLevel = LogLevel.WARNING
    opset: int = 17
    fallback_policy: FallbackPolicy = attrs.field(factory=FallbackPolicy.default)
    fallback_retry: bool = False
    deepcopy_before_export: bool = True
    save_onnx: bool = False
    onnx_prefix: str = ""
    save_onnx_path: str = ""
    max_cached_graphs: int = 8
    sources: Mapping[str, str] = attrs.field(factory=dict, eq=False)

    @classmethod
    def resolve(
        cls,
        debug_options: DebugOptions | None = None,
        *,
        fallback_policy: object = None,
        opset: object = None,
        env: Mapping[str, str] | None = None,
    ) -> RuntimeOptions:
        """Merge code arguments with the environment; the environment wins, as upstream documented."""
        env = os.environ if env is None else env
        debug = debug_options or DebugOptions()
        values: dict[str, object] = {
            "log_level": debug.log_level,
            "save_onnx": debug.save_onnx,
            "onnx_prefix": debug.onnx_prefix,
            "save_onnx_path": debug.save_path,
        }
        sources = dict.fromkeys(values, "DebugOptions")
        if fallback_policy is not None:
            values["fallback_policy"] = FallbackPolicy.parse(fallback_policy, "fallback_policy")
            sources["fallback_policy"] = "argument"
        if opset is not None:
            values["opset"] = _parse_opset(opset, "opset")
            sources["opset"] = "argument"
        parsers = {
            "ORTMODULE_LOG_LEVEL": ("log_level", LogLevel.parse),
            "ORTMODULE_ONNX_OPSET_VERSION": ("opset", _parse_opset),
            "ORTMODULE_FALLBACK_POLICY": ("fallback_policy", FallbackPolicy.parse),
            "ORTMODULE_FALLBACK_RETRY": ("fallback_retry", _parse_bool),
            "ORTMODULE_DEEPCOPY_BEFORE_MODEL_EXPORT": ("deepcopy_before_export", _parse_bool),
            "ORTMODULE_SAVE_ONNX_PATH": ("save_onnx_path", lambda v, _s: str(v)),
        }
        for var, (key, parse) in parsers.items():
            if env.get(var, "") != "":
                values[key] = parse(env[var], var)
                sources[key] = f"env {var}"
        if env.get("ORTMODULE_SAVE_ONNX_PATH", "") != "" and not values["save_onnx"]:
            # Setting the directory is asking for the files: save them even without DebugOptions(save_onnx=True).
            values["save_onnx"] = True
            values["onnx_prefix"] = values["onnx_prefix"] or "ortcore"
            sources["save_onnx"] = sources["onnx_prefix"] = "env ORTMODULE_SAVE_ONNX_PATH"
        return cls(**values, sources=sources)

    @property
    def save_dir(self) -> str:
        return self.save_onnx_path or os.getcwd()
