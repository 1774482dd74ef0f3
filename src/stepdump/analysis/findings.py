"""The result type of checks, shared by the rules, the CLI and the report."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import IntEnum
from typing import Any


class Severity(IntEnum):
    """Ordered so that ``finding.severity >= Severity.WARNING`` reads naturally."""

    INFO = 10
    WARNING = 20
    ERROR = 30

    @classmethod
    def parse(cls, text: str) -> Severity:
        try:
            return cls[text.upper()]
        except KeyError:
            from stepdump.errors import ConfigError

            raise ConfigError(f"unknown severity {text!r}; choose info, warning or error") from None


@dataclass(frozen=True)
class Finding:
    """One thing a check rule found.

    Attributes:
        rule: Name of the rule (``nan_inf``, ``loss_spike``, ...).
        severity: How bad it is.
        step: First step where it shows (None for whole-run findings).
        kind: Tensor kind involved, or None for scalar-based rules.
        tensor: Tensor (or scalar) name involved, or None.
        value: The measured value that triggered the rule.
        threshold: The threshold it was compared against.
        message: What was found, how bad it is, and the next thing to do.
        tensors: Every tensor (or scalar) the finding is about, when one cause
            touches several (``tensor`` is the one the message leads with):
            one finding per cause, not one per weight. Empty when it is only
            ``tensor``.
    """

    rule: str
    severity: Severity
    step: int | None
    kind: str | None
    tensor: str | None
    value: float | None
    threshold: float | None
    message: str
    tensors: tuple[str, ...] = field(default=())

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict (severity as its lower-case name, ``tensors`` as a list)."""
        d = asdict(self)
        d["severity"] = self.severity.name.lower()
        d["tensors"] = list(self.tensors)
        return d
