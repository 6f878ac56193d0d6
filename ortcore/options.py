"""User-facing option types: log levels, fallback policy, debug options, and the parsers of option values.

Every value a user can write (an argument, a config key or an ``ORTMODULE_*`` variable) is parsed here, and a bad
one raises :class:`OptionError` naming the value, where it came from and what is allowed.
"""

from __future__ import annotations

import difflib
import enum
import logging
import os
from typing import TYPE_CHECKING

import attrs

from .errors import OptionError, OptionTypeError

if TYPE_CHECKING:
    import onnxruntime

# The ONNX opset ortcore exports with unless told otherwise (upstream's ``ONNX_OPSET_VERSION``; ORT 1.19's training
# kernels are complete up to it).
ONNX_OPSET_VERSION = 17


def _suggest(value: str, allowed: list[str]) -> str:
    close = difflib.get_close_matches(str(value).upper(), allowed, n=1)
    return f" Did you mean {close[0]!r}?" if close else ""


def _suggest_flag(name: str, allowed: list[str]) -> str:
    """The fallback flag ``name`` is a misspelling of, if it is a close one: compared without the ``FALLBACK_`` prefix
    every flag shares (with it, any ``FALLBACK_<word>`` looks like every flag), and with a high cutoff, since a far
    guess can be FALLBACK_DISABLE, the one flag that turns every fallback off."""
    stems = {flag.removeprefix("FALLBACK_"): flag for flag in allowed}
    close = difflib.get_close_matches(name.removeprefix("FALLBACK_"), list(stems), n=1, cutoff=0.8)
    return f" Did you mean {stems[close[0]]!r}?" if close else ""


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
            return cls._alone_if_disable(value, value, source)
        if isinstance(value, int) and not isinstance(value, bool) and 0 < value < 256:
            return cls._alone_if_disable(cls(value), value, source)
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
                        f"{', '.join(allowed)}, joined with '|' (FALLBACK_DISABLE alone).{_suggest_flag(name, allowed)}"
                    )
                policy |= cls[name]
            return cls._alone_if_disable(policy, value, source)
        raise OptionError(
            f"{source}={value!r} is not a fallback policy; allowed: {', '.join(cls.__members__)}, joined with '|' "
            "(FALLBACK_DISABLE alone)"
        )

    @classmethod
    def _alone_if_disable(cls, policy: FallbackPolicy, value: object, source: str) -> FallbackPolicy:
        """Refuse FALLBACK_DISABLE with other flags: it turns every fallback off, so the others would be dropped
        silently, whichever of the two the user meant."""
        others = [flag.name for flag in cls if flag in policy and flag is not cls.FALLBACK_DISABLE]
        if cls.FALLBACK_DISABLE in policy and others:
            raise OptionError(
                f"{source}={value!r}: FALLBACK_DISABLE cannot be combined with other flags ({', '.join(others)}): "
                "FALLBACK_DISABLE turns every fallback off, so they would have no effect. Use FALLBACK_DISABLE "
                "alone (every failure raises) or the other flags alone (those failures fall back to PyTorch)"
            )
        return policy

    def allows(self, flag: FallbackPolicy) -> bool:
        """Whether a failure of kind ``flag`` falls back (never when FALLBACK_DISABLE is set)."""
        return FallbackPolicy.FALLBACK_DISABLE not in self and flag in self


def parse_bool(value: object, source: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise OptionError(f"{source}={value!r} is not a boolean; allowed: 1/0, true/false, yes/no, on/off")


def parse_opset(value: object, source: str) -> int:
    try:
        opset = int(str(value).strip()) if not isinstance(value, bool) else None
    except ValueError:
        opset = None
    if opset is None or not 14 <= opset <= 20:
        raise OptionError(f"{source}={value!r} is not a supported ONNX opset; allowed: an integer from 14 to 20")
    return opset


def _debug_log_level(value: object) -> LogLevel:
    try:
        return LogLevel.parse(value, "log_level")
    except OptionError as e:
        raise OptionTypeError(f"Expected log_level of type LogLevel, got {type(value)}. {e}") from None


@attrs.frozen
class DebugOptions:
    """Debugging switches: what to log and whether to save the ONNX graphs.

    Example::

        ORTModule(model, DebugOptions(save_onnx=True, log_level=LogLevel.INFO, onnx_prefix="bert"))

    ``ORTMODULE_LOG_LEVEL`` overrides ``log_level``; ``ORTMODULE_SAVE_ONNX_PATH`` (else ``save_path``, else the
    working directory) is the directory in which the graphs are written (see docs/debugging.md for the file names).

    The arguments are checked here, as upstream's ``DebugOptions`` checks them: a ``log_level`` that is no
    :class:`LogLevel` (nor its name or value) and an ``onnx_prefix`` that is not a string raise
    :class:`~ortcore.errors.OptionTypeError` (a ``TypeError``); with ``save_onnx``, an empty prefix raises
    :class:`~ortcore.errors.OptionError` (a ``ValueError``) and a directory that is not writable raises ``OSError``.
    """

    log_level: LogLevel = attrs.field(default=LogLevel.WARNING, converter=_debug_log_level)
    save_onnx: bool = attrs.field(default=False, converter=lambda v: parse_bool(v, "save_onnx"))
    onnx_prefix: str = attrs.field(default="")
    save_path: str = attrs.field(default="")

    @onnx_prefix.validator
    def _check_prefix(self, _attribute: attrs.Attribute, value: object) -> None:
        if not isinstance(value, str):
            raise OptionTypeError(
                f"Expected name prefix of type str, got {type(value)}. onnx_prefix={value!r} must be a string: "
                "it starts the name of each saved file"
            )
        if self.save_onnx and not value.strip():
            raise OptionError(
                f"onnx_prefix must be provided when save_onnx is set. onnx_prefix={value!r}: save_onnx=True needs "
                "a non-empty onnx_prefix to name the saved files"
            )

    @save_path.validator
    def _check_save_path(self, _attribute: attrs.Attribute, value: object) -> None:
        if not isinstance(value, str):
            raise OptionTypeError(f"save_path={value!r} must be a string (a directory), not {type(value).__name__}")

    def __attrs_post_init__(self) -> None:
        if not self.save_onnx:
            return
        directory = self.save_directory
        if not (os.path.isdir(directory) and os.access(directory, os.W_OK)):
            raise OSError(
                f"Directory {directory} is not writable. Please set the ORTMODULE_SAVE_ONNX_PATH environment "
                "variable to a writable path (save_onnx=True writes the ONNX graphs there)."
            )

    @property
    def save_directory(self) -> str:
        """Where the graphs go: ``ORTMODULE_SAVE_ONNX_PATH``, else ``save_path``, else the working directory."""
        return os.environ.get("ORTMODULE_SAVE_ONNX_PATH") or self.save_path or os.getcwd()


def write_executed_graph(so: onnxruntime.SessionOptions, path: str) -> None:
    """Have ORT write the graph it runs to ``path`` when it creates the session (``so``: an
    ``onnxruntime.SessionOptions``; the session plan and the core's own read-back of the executed graph share it)."""
    so.optimized_model_filepath = path
    if so.log_severity_level == LogLevel.WARNING.ort_severity:
        # ORT warns on every such write that an ORT_ENABLE_ALL graph suits this machine only; the copies ortcore
        # writes (debug files, a cache keyed by machine, the core's own read-back) are meant for it. Errors still show.
        so.log_severity_level = LogLevel.ERROR.ort_severity
