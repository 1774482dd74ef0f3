"""The result type of checks, shared by the rules, the CLI and the report."""

from __future__ import annotations

from dataclasses import asdict, dataclass
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
        message: One human sentence saying what was found and what it suggests.
    """

    rule: str
    severity: Severity
    step: int | None
    kind: str | None
    tensor: str | None
    value: float | None
    threshold: float | None
    message: str

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["severity"] = self.severity.name.lower()
        return d
