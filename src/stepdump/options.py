"""The Recorder's option groups, for configs built once and reused (docs/concepts.md, "Recorder options").

Every :class:`stepdump.Recorder` keyword belongs to one of these frozen, keyword-only groups that
check themselves when built; the plain keywords (``every=100, codec="zstd"``) stay the everyday
spelling and mean the same thing::

    from stepdump.options import StepSchedule, StoreOptions
    stepdump.Recorder(path, model, opt, schedule=StepSchedule(every=100), store=StoreOptions(codec="zstd"))

* :class:`RecordOptions` (``record=``): what: kinds, name globs, modules, profiling;
* a schedule (``schedule=``), one mode at a time: :class:`StepSchedule`, :class:`KeyframeSchedule`,
  :class:`GradientLogSchedule`, :class:`RingSchedule`;
* :class:`StoreOptions` (``store=``): how: codec, delta chains, queues, durability, and
  :class:`Remote` (``remote=``): publishing to an fsspec URL;
* :class:`ResolvedOptions`: what a Recorder was given, all groups resolved (``rec.options``);
* :class:`TriggerInfo`: what a ring's trigger callable (``trigger=``) is given at each step.
"""

from __future__ import annotations

from stepdump.capture.options import (
    GradientLogSchedule,
    KeyframeSchedule,
    RecordOptions,
    RingSchedule,
    Schedule,
    StepSchedule,
    StoreOptions,
)
from stepdump.capture.options import RecorderOptions as ResolvedOptions
from stepdump.capture.triggers import TriggerInfo
from stepdump.capture.upload import Remote

__all__ = [
    "GradientLogSchedule",
    "KeyframeSchedule",
    "RecordOptions",
    "Remote",
    "ResolvedOptions",
    "RingSchedule",
    "Schedule",
    "StepSchedule",
    "StoreOptions",
    "TriggerInfo",
]
