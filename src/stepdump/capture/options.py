"""The Recorder's options, grouped: what to record, when, and how to store it.

Every option of :class:`stepdump.Recorder` belongs to one frozen, keyword-only
dataclass that checks itself when it is built (so a bad value fails at the
line that wrote it, with a message that says what to do):

* :class:`RecordOptions` — what: tensor kinds, name globs, modules, profiling;
* a schedule — when, exactly one of :class:`StepSchedule` (``every`` /
  ``stats_every``), :class:`KeyframeSchedule` (full state every K steps, RNG and
  batch every step, for replay) or :class:`RingSchedule` (the last N steps in
  memory, written when a trigger fires). A mode is its own type, so a
  combination that means nothing (a trigger without a ring, a ring and
  ``every=``) cannot be written;
* :class:`StoreOptions` — how: codec, delta chains, queue depth, staging memory, durability,
  segment size, publishing to a URL, the ``stats.parquet`` written at close.

The common case needs none of them (``Recorder(path, model, opt, every=100)``):
each field is also accepted as a plain Recorder keyword of the same name, and
:func:`resolve` is the one place that turns those keywords into the groups.
The flat names of the schedules are ``every``, ``stats_every``,
``keyframe_every``, ``gradient_log`` and ``ring`` / ``trigger`` / ``after``. Giving a group and
one of its fields as a keyword is a :class:`~stepdump.ConfigError`.

A new recording mode (a gradient log, a lean mode) is a new schedule type
added to ``SCHEDULES``, plus its flat keyword (``gradient_log=K``) in
``_SCHEDULE`` and :func:`_flat_schedule`; nothing else here changes.

Public names (importable from this module): ``RecordOptions``,
``StepSchedule``, ``KeyframeSchedule``, ``RingSchedule``, ``Schedule``,
``StoreOptions``, ``RecorderOptions``.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Union

from stepdump.capture.extra import check_extra_state
from stepdump.capture.guard import ON_ERROR
from stepdump.capture.selection import CORE_KINDS, Every, StepSet, check_kinds, patterns
from stepdump.capture.sharding import Ranks, check_ranks
from stepdump.capture.triggers import Trigger
from stepdump.capture.triggers import resolve as resolve_trigger
from stepdump.capture.upload import Remote
from stepdump.errors import ConfigError
from stepdump.store.queries import MAX_STEP
from stepdump.store.storage import StorageFactory

__all__ = [
    "GradientLogSchedule",
    "KeyframeSchedule",
    "RecordOptions",
    "RecorderOptions",
    "RingSchedule",
    "Schedule",
    "StepSchedule",
    "StoreOptions",
]

ACTIVATION_KINDS = ("activations", "activation_grads")
FROZEN = ("once", "fingerprint")
FINGERPRINTS = ("auto", "xxh3", "dmix64")  # StoreOptions.fingerprint


def _positive_int(value: Any, what: str, hint: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{what}={value!r}: {hint}")


def _set(obj: Any, name: str, value: Any) -> None:
    object.__setattr__(obj, name, value)  # normalising a frozen dataclass in __post_init__


def _steps(obj: Any, name: str) -> None:
    """Check a step schedule value; a one-shot iterable becomes a frozenset (it is read twice)."""
    value = getattr(obj, name)
    listed = not (value is None or isinstance(value, (int, range, str, bytes)) or callable(value))
    if listed:
        try:
            value = tuple(value)  # read it once: a generator is empty the second time
        except TypeError:
            listed = False  # not iterable: StepSet says what it takes
    StepSet(value, name)
    if listed:
        _set(obj, name, frozenset(int(s) for s in value))


@dataclass(frozen=True, kw_only=True)
class RecordOptions:
    """What the Recorder records.

    Attributes:
        capture: Kinds of tensors: any of ``params`` (module buffers come
            with them), ``grads``, ``optimizer``, ``activations``,
            ``activation_grads``, ``inputs``.
        include: Glob(s) over parameter names to record (default all).
        exclude: Glob(s) over parameter names to leave out.
        modules: Glob(s) over module names whose outputs are recorded; only
            with ``activations`` / ``activation_grads`` in ``capture``
            (default: every module).
        profile: Record per-step timing and memory as ``sys/*`` scalars
            (see :meth:`stepdump.types.Run.profile`).
        extra_state: Objects recorded beside the model, by name:
            ``{"ema": ema_model}`` (an ``AveragedModel``, a timm / torch-ema EMA, anything with
            ``state_dict()`` and ``load_state_dict()``). Each one's ``state_dict()`` is recorded
            at full steps (keyframes and the final record too) as it is when the update begins,
            and ``Run.restore(..., extra_state={...})`` loads it (docs/recipes/ema.md).
        frozen: What a full step stores of the params with ``requires_grad=False`` (a frozen
            base under adapters): ``"once"`` (default) stores their bytes when first recorded
            and again only if they change; every full step checks their fingerprint and names
            those bytes. ``"fingerprint"`` never stores them, only their stats and fingerprint:
            ``restore`` then checks the base it is given against them (docs/recipes/lora.md).
    """

    capture: tuple[str, ...] | str = CORE_KINDS
    include: tuple[str, ...] | str | None = "*"
    exclude: tuple[str, ...] | str | None = None
    modules: tuple[str, ...] | str | None = None
    profile: bool = True
    extra_state: Mapping[str, Any] | None = None
    frozen: str = "once"

    def __post_init__(self) -> None:
        _set(self, "capture", check_kinds(self.capture))
        _set(self, "include", tuple(patterns(self.include, ["*"], "include")))
        _set(self, "exclude", tuple(patterns(self.exclude, [], "exclude")))
        if self.modules is not None:
            _set(self, "modules", tuple(patterns(self.modules, [], "modules")))
            if not any(k in self.capture for k in ACTIVATION_KINDS):
                raise ConfigError(
                    f"modules={self.modules!r} picks the modules whose outputs are recorded, but capture= has "
                    "neither 'activations' nor 'activation_grads': add one of them to capture=, or leave modules= out"
                )
        if not isinstance(self.profile, bool):
            raise ConfigError(f"profile={self.profile!r}: give True or False")
        _set(self, "extra_state", check_extra_state(self.extra_state))
        if self.frozen not in FROZEN:
            raise ConfigError(f"frozen={self.frozen!r}: choose 'once' (frozen params stored once, then checked by "
                              "fingerprint) or 'fingerprint' (never stored: restore checks the base it is given)")


@dataclass(frozen=True, kw_only=True)
class StepSchedule:
    """Tensors in full at some steps, stats and fingerprints at others (the default schedule).

    Each field is an int n (every n-th step), a range, an iterable of steps, a
    callable ``step -> bool``, or None (never).

    Attributes:
        every: Steps whose tensors are stored in full (default every step).
        stats_every: Steps whose per-tensor stats and fingerprints are stored
            (default every step, so ``diff`` and ``check`` see every step).
    """

    every: Every = 1
    stats_every: Every = 1

    def __post_init__(self) -> None:
        _steps(self, "every")
        _steps(self, "stats_every")

    def steps(self) -> tuple[Every, Every]:
        """``(full, stats)``: the steps stored in full and the steps with stats."""
        return self.every, self.stats_every


@dataclass(frozen=True, kw_only=True)
class KeyframeSchedule:
    """Keyframes for :func:`stepdump.replay`: full state every ``every`` steps and, at
    every step, stats, the RNG state and the batch given to ``Recorder.log_batch``,
    so any step can be rebuilt bit-exactly by replaying from its keyframe.
    Flat spelling: ``keyframe_every=K``.

    Attributes:
        every: Steps between keyframes (K).
    """

    every: int

    def __post_init__(self) -> None:
        _positive_int(self.every, "keyframe_every", "give a positive number of steps between keyframes")

    def steps(self) -> tuple[Every, Every]:
        """``(full, stats)``: a keyframe every K steps, stats at every step."""
        return self.every, 1


@dataclass(frozen=True, kw_only=True)
class RingSchedule:
    """Flight-recorder mode: full copies of the last ``size`` steps are kept in memory
    (``size`` x one step's size) and written only when ``trigger`` fires, then
    ``after`` more steps in full; stats and fingerprints are written every step.
    One episode per condition: while the trigger stays true after that, steps are
    held as usual (logged once), and it fires again only after a step where it
    was false. Flat spelling: ``ring=N, trigger=..., after=...``.

    Attributes:
        size: Steps kept in memory.
        trigger: ``"nan_inf"`` (default), ``"loss_spike"``, or a callable
            ``(stepdump.options.TriggerInfo) -> bool``.
        after: Steps recorded in full after the trigger step (default
            ``size``), before going back to holding steps in memory.
    """

    size: int
    trigger: Trigger | str = "nan_inf"
    after: int | None = None

    def __post_init__(self) -> None:
        _positive_int(self.size, "ring", "give the number of steps to keep in memory")
        resolve_trigger(self.trigger)  # a misspelt trigger name fails here, before anything is created
        if self.after is not None and (isinstance(self.after, bool) or not isinstance(self.after, int)
                                       or self.after < 0):
            raise ConfigError(f"after={self.after!r}: give the number of steps (0 or more) to record in full "
                              "after the trigger step, or None for as many as the ring holds")

    @property
    def steps_after(self) -> int:
        """Steps written in full after the trigger step."""
        return self.size if self.after is None else self.after

    def steps(self) -> tuple[Every, Every]:
        """``(full, stats)``: the ring decides the full steps itself; stats at every step."""
        return None, 1


@dataclass(frozen=True, kw_only=True)
class GradientLogSchedule:
    """Every step's full state for the price of its gradients: grads in full at every
    step, params and optimizer state in full only every ``every`` steps (keyframes),
    with stats, exact fingerprints and the param groups' hyperparameters at every
    step. Reading rebuilds params and optimizer state at any step by re-applying the
    recorded updates from the keyframe before it, verified against the recorded
    fingerprints (docs/gradient-log.md). Flat spelling: ``gradient_log=K``.

    Attributes:
        every: Steps between keyframes (K).
    """

    every: int

    def __post_init__(self) -> None:
        _positive_int(self.every, "gradient_log", "give a positive number of steps between keyframes")

    def steps(self) -> tuple[Every, Every]:
        """``(full, stats)``: a keyframe every K steps, stats (and grads) at every step."""
        return self.every, 1


Schedule = Union[StepSchedule, KeyframeSchedule, RingSchedule, GradientLogSchedule]
SCHEDULES = (StepSchedule, KeyframeSchedule, RingSchedule, GradientLogSchedule)


@dataclass(frozen=True, kw_only=True)
class StoreOptions:
    """How the Recorder stores what it records.

    Attributes:
        codec: Blob codec, see ``stepdump.store.codecs.CODEC_NAMES`` and
            docs/performance.md; ``delta-lz4`` / ``delta-zstd`` store params,
            grads and optimizer state as differences from their previous blob.
        delta_chain: With a delta codec, every ``delta_chain``-th blob of a
            series is self-contained, so a read decodes at most that many
            blobs (a plain codec has no chains).
        queue_depth: Steps that may be in flight to the writer before
            training waits (each holds staging buffers, ``staging_bytes`` in all).
        staging_bytes: Host memory for staging copies, all steps in flight
            together (default 64 MiB). Tensors beyond it are written straight
            from the live tensor while the training thread waits in the
            optimizer's pre-hook, so memory does not grow with the model; a
            bigger budget lets training go on sooner. 0 copies nothing. Ring
            mode ignores it: it keeps ``ring`` whole steps in memory.
        durability: ``"flush"`` (survives a killed process) or ``"fsync"``
            (also survives power loss, slower); docs/reliability.md has numbers.
        segment_bytes: Size at which a new segment file is started.
        remote: For a URL path (``s3://bucket/run``): how the run is published,
            a :class:`stepdump.options.Remote` or a dict of its fields.
        storage: Builds what segment files are written through, from this
            rank's local directory: a callable returning a
            :class:`~stepdump.store.storage.Storage` (None: files,
            :class:`~stepdump.store.storage.LocalStorage`). A wrapper can
            throttle or count appends; tests pass one that fails like a full disk.
        fingerprint: The fingerprint kind of each recorded tensor (FORMAT.md, "Fingerprint
            kinds"): ``"auto"`` (default) dmix64 for CUDA tensors (computed on the device, no host
            copy at stats steps), xxh3 for CPU tensors, so a CPU run is a format-1 store;
            ``"xxh3"`` xxh3 everywhere (CUDA bytes hashed on the host); ``"dmix64"`` dmix64
            everywhere (a CPU run meant to be compared with GPU runs by fingerprint). A tensor
            keeps its first kind at every step.
        stats_parquet: Write ``stats.parquet`` into the run directory at ``close()``: every stat
            row of the run as one Parquet file, for DuckDB, Polars or Spark to query in place
            (docs/scale.md; a derived copy of the catalog's stats, FORMAT.md). Needs pyarrow
            (``stepdump[arrow]``); without it nothing is written. A failure to write it is one
            warning, never an error out of ``close()``.
    """

    codec: str = "raw"
    delta_chain: int = 8
    queue_depth: int = 2
    staging_bytes: int = 64 << 20
    durability: str = "flush"
    segment_bytes: int = 1 << 30
    remote: Remote | Mapping[str, Any] | None = None
    storage: StorageFactory | None = None
    fingerprint: str = "auto"
    stats_parquet: bool = True

    def __post_init__(self) -> None:
        # The store layer, loaded when a Recorder is configured (not at import).
        from stepdump.store.codecs import get_codec
        from stepdump.store.delta import MAX_DELTA_CHAIN

        if not isinstance(self.codec, str):
            raise ConfigError(f"codec={self.codec!r}: give a codec name such as 'raw', 'zstd' or 'delta-lz4'")
        get_codec(self.codec)  # an unknown name fails here, not in the writer
        if (isinstance(self.delta_chain, bool) or not isinstance(self.delta_chain, int)
                or not 1 <= self.delta_chain <= MAX_DELTA_CHAIN):
            raise ConfigError(f"delta_chain={self.delta_chain!r}: give a number of blobs from 1 (no deltas) to "
                              f"{MAX_DELTA_CHAIN} (readers follow no longer chains)")
        _positive_int(self.queue_depth, "queue_depth", "queue_depth must be at least 1 (steps in flight)")
        if isinstance(self.staging_bytes, bool) or not isinstance(self.staging_bytes, int) or self.staging_bytes < 0:
            raise ConfigError(f"staging_bytes={self.staging_bytes!r}: give the host memory for staging copies in "
                              "bytes (0 or more, e.g. 64 << 20)")
        if self.durability not in ("flush", "fsync"):
            raise ConfigError(f"durability={self.durability!r}: choose 'flush' or 'fsync'")
        _positive_int(self.segment_bytes, "segment_bytes", "give the size of a segment file in bytes")
        if self.remote is not None:
            _set(self, "remote", Remote.coerce(self.remote))
        if self.storage is not None and not callable(self.storage):
            raise ConfigError(f"storage={self.storage!r}: give a callable that takes the run's directory and "
                              "returns a Storage (stepdump.store.storage), e.g. LocalStorage")
        if not isinstance(self.fingerprint, str) or self.fingerprint not in FINGERPRINTS:
            raise ConfigError(f"fingerprint={self.fingerprint!r}: choose 'auto' (dmix64 on CUDA, xxh3 on the CPU), "
                              "'xxh3' (every tensor hashed on the host) or 'dmix64' (every tensor, CPU too)")
        if not isinstance(self.stats_parquet, bool):
            raise ConfigError(f"stats_parquet={self.stats_parquet!r}: give True (write stats.parquet at close()) "
                              "or False")


class Default:
    """The default of a flat Recorder keyword: reads as the option group's default in
    ``help(stepdump.Recorder)``, and tells :func:`resolve` that the keyword was left out (a
    keyword given beside its group is an error, even with the default value)."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __repr__(self) -> str:
        return repr(self.value)


_RECORD = ("capture", "include", "exclude", "modules", "profile", "extra_state", "frozen")
_SCHEDULE = ("every", "stats_every", "keyframe_every", "gradient_log", "ring", "trigger", "after")
_STORE = ("codec", "delta_chain", "queue_depth", "staging_bytes", "durability", "segment_bytes", "remote", "storage",
          "fingerprint", "stats_parquet")
_GROUP_OF = {**dict.fromkeys(_RECORD, "record"), **dict.fromkeys(_SCHEDULE, "schedule"),
             **dict.fromkeys(_STORE, "store")}
_GROUP_CLASS = {"record": "RecordOptions", "schedule": "a StepSchedule, KeyframeSchedule, RingSchedule or GradientLogSchedule",
                "store": "StoreOptions"}

# The flat schedule keywords that are not a StepSchedule field; None means "not this mode".
_SCHEDULE_ONLY = {"keyframe_every": None, "gradient_log": None, "ring": None, "trigger": "nan_inf", "after": None}


def unset(name: str) -> Any:
    """The default of the flat Recorder keyword ``name`` (its group's default, see :class:`Default`)."""
    for group in (RecordOptions, StepSchedule, StoreOptions):
        for f in fields(group):
            if f.name == name:
                return Default(f.default)
    return Default(_SCHEDULE_ONLY[name])


@dataclass(frozen=True, kw_only=True)
class RecorderOptions:
    """Everything a Recorder was configured with (``Recorder.options``), checked as a whole.

    Attributes:
        record: What is recorded.
        schedule: When (one of the schedule types).
        store: How it is stored.
        on_error: ``"warn"`` (default: a failure inside the Recorder stops
            recording, never the training) or ``"raise"`` (strict, for tests).
        resume: Append to an existing run, continuing its step numbers.
        start_step: Number of the first recorded step (None: 0, or the step
            after the last recorded one when resuming).
        metadata: JSON-able dict stored with the run.
        ranks: Ranks that record under ``torch.distributed``.
        auto_capture: Take each record at the optimizer's step pre-hook (and
            notice GradScaler skips). False: the caller calls
            ``Recorder.capture()`` when the grads are final (a framework callback).
    """

    record: RecordOptions = field(default_factory=RecordOptions)
    schedule: Schedule = field(default_factory=StepSchedule)
    store: StoreOptions = field(default_factory=StoreOptions)
    on_error: str = "warn"
    resume: bool = False
    start_step: int | None = None
    metadata: Mapping[str, Any] | None = None
    ranks: Ranks = "all"
    auto_capture: bool = True

    def __post_init__(self) -> None:
        for name, cls in (("record", RecordOptions), ("schedule", SCHEDULES), ("store", StoreOptions)):
            if not isinstance(getattr(self, name), cls):
                raise ConfigError(f"{name}= takes {_GROUP_CLASS[name]} (from stepdump.options), "
                                  f"got {type(getattr(self, name)).__name__}")
        if self.on_error not in ON_ERROR:
            raise ConfigError(f"on_error={self.on_error!r}: choose 'raise' or 'warn'")
        for name in ("resume", "auto_capture"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name}={getattr(self, name)!r}: give True or False")
        if self.start_step is not None and (isinstance(self.start_step, bool) or not isinstance(self.start_step, int)
                                            or not 0 <= self.start_step <= MAX_STEP):
            raise ConfigError(f"start_step={self.start_step!r}: give a step number (0 to {MAX_STEP}), or None")
        if self.metadata is not None:
            try:
                if not isinstance(self.metadata, Mapping):
                    raise TypeError(type(self.metadata).__name__)
                json.dumps(dict(self.metadata), allow_nan=False)
            except (TypeError, ValueError) as e:
                raise ConfigError(f"metadata= must be a dict that JSON can hold (str keys; numbers, strings, "
                                  f"lists, dicts), it is stored with the run: {e}") from None
            _set(self, "metadata", dict(self.metadata))
        check_ranks(self.ranks)
        if self.record.frozen == "fingerprint" and isinstance(self.schedule, GradientLogSchedule):
            raise ConfigError("frozen='fingerprint' does not go with gradient_log=: a rebuild starts from the "
                              "params stored at a keyframe; leave frozen= out (frozen params are stored once)")


def refuse_unknown(given: Iterable[str], known: Iterable[str]) -> None:
    """Raise a :class:`~stepdump.ConfigError` naming the first keyword of ``given`` not in ``known``
    (and the nearest known one)."""
    known = list(known)
    unknown = [k for k in given if k not in known]
    if unknown:
        near = difflib.get_close_matches(unknown[0], known, n=1)
        hint = f"did you mean {near[0]}=? " if near else ""
        raise ConfigError(f"Recorder got an unknown option {unknown[0]}=; {hint}see help(stepdump.Recorder) and "
                          "stepdump.options for the option groups")


def resolve(record: RecordOptions | None = None, schedule: Schedule | None = None,
            store: StoreOptions | None = None, **kwargs: Any) -> RecorderOptions:
    """Build the RecorderOptions of ``Recorder(..., record=, schedule=, store=, **kwargs)``.

    The one place where the flat keywords become option groups. ``kwargs``
    holds the flat keywords the caller gave, plus ``on_error``, ``resume``,
    ``start_step``, ``metadata``, ``ranks`` and ``auto_capture``.
    """
    top = {f.name for f in fields(RecorderOptions)} - {"record", "schedule", "store"}
    kwargs = {k: v for k, v in kwargs.items() if not isinstance(v, Default)}  # left out
    flat = {k: v for k, v in kwargs.items() if k not in top}
    refuse_unknown(flat, _GROUP_OF)
    groups = {"record": record, "schedule": schedule, "store": store}
    for key in flat:
        group = _GROUP_OF[key]
        if groups[group] is not None:
            raise ConfigError(f"{key}= is also set by {group}=; give it one way: inside {group}=, or as {key}= "
                              f"without {group}=")
    if record is None:
        record = RecordOptions(**{k: flat[k] for k in _RECORD if k in flat})
    if schedule is None:
        schedule = _flat_schedule({k: flat[k] for k in _SCHEDULE if k in flat})
    if store is None:
        store = StoreOptions(**{k: flat[k] for k in _STORE if k in flat})
    return RecorderOptions(record=record, schedule=schedule, store=store,
                           **{k: v for k, v in kwargs.items() if k in top})


def _flat_schedule(given: dict[str, Any]) -> Schedule:
    """``every=`` / ``stats_every=`` / ``keyframe_every=`` / ``gradient_log=`` / ``ring=, trigger=, after=``
    as one schedule."""
    # None is how these say "not given" (an integration may pass them through as None).
    ring, keyframe_every = given.pop("ring", None), given.pop("keyframe_every", None)
    gradient_log = given.pop("gradient_log", None)
    if gradient_log is not None:
        others = [k for k, v in {"ring": ring, "keyframe_every": keyframe_every, **given}.items() if v is not None]
        if others:
            raise ConfigError(f"gradient_log=K decides what each step stores (grads every step, full state every K "
                              f"steps); do not combine it with {', '.join(f'{k}=' for k in others)}")
        return GradientLogSchedule(every=gradient_log)
    ring_args = {k: given.pop(k) for k in ("trigger", "after") if given.get(k) is not None}
    given.pop("trigger", None)
    given.pop("after", None)
    if ring is None and ring_args:
        raise ConfigError(f"{' and '.join(f'{k}=' for k in ring_args)} apply to the flight-recorder ring only; "
                          "pass ring=N (steps kept in memory) with them, or leave them out")
    if ring is not None:
        others = [*given, *(["keyframe_every"] if keyframe_every is not None else [])]
        if others:
            raise ConfigError(f"ring= decides which steps are stored in full (and writes stats every step); do "
                              f"not combine it with {', '.join(f'{k}=' for k in others)}")
        return RingSchedule(size=ring, **ring_args)
    if keyframe_every is not None:
        if given:
            raise ConfigError("keyframe_every sets every= and stats_every= itself (full every K steps, stats "
                              f"every step); pass only keyframe_every, not {', '.join(f'{k}=' for k in given)}")
        return KeyframeSchedule(every=keyframe_every)
    return StepSchedule(**given)


def schedule_meta(schedule: Schedule) -> dict[str, Any]:
    """What the run's catalog meta says about the schedule (FORMAT.md ``meta``)."""
    full, stats = schedule.steps()
    return {"every": StepSet(full, "every").description,
            "keyframe_every": schedule.every if isinstance(schedule, KeyframeSchedule) else None,
            "gradient_log": schedule.every if isinstance(schedule, GradientLogSchedule) else None,
            "stats_every": StepSet(stats, "stats_every").description}

