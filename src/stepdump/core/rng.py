"""RNG state of every generator a training step may draw from."""

from __future__ import annotations

import ctypes
import random
import re
import struct
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from stepdump.errors import ConfigError, CorruptDataError, RestoreMismatchError

_MT_WORDS = 624  # MT19937: 624 uint32 words, then the position (a C int)
# numpy's global bit generator and a view of its state's bytes (made once: reading a view is one
# C call, where ctypes.string_at was a Python function, a foreign call and its argument conversions,
# a path of cold code at every update that cost tens of microseconds there).
_NP_STATE: tuple[Any, np.ndarray] | None = None


def _memory(address: int, size: int) -> np.ndarray:
    """A uint8 view of ``size`` bytes at ``address`` (the caller keeps their owner alive)."""
    return np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(address))


def numpy_mt() -> tuple[bytes, int] | None:
    """numpy's global MT19937 words and position, read from its C struct (about 1 us;
    ``np.random.get_state()`` takes about 100 us). None where that struct is not reachable, and
    where numpy's global bit generator is not an MT19937 (``np.random.set_bit_generator``): another
    one's struct is smaller and laid out otherwise."""
    global _NP_STATE
    try:
        bitgen = np.random.mtrand._rand._bit_generator  # type: ignore[attr-defined]
        if type(bitgen) is not np.random.MT19937:  # exactly: only its struct is read as 624 words
            return None
        if _NP_STATE is None or _NP_STATE[0] is not bitgen:  # its address, found once (.ctypes makes objects)
            _NP_STATE = (bitgen, _memory(bitgen.ctypes.state_address, _MT_WORDS * 4 + 4))
        raw = _NP_STATE[1].tobytes()
    except Exception:  # noqa: BLE001 - another numpy: the caller falls back to get_state
        return None
    return raw[: _MT_WORDS * 4], int.from_bytes(raw[_MT_WORDS * 4:], "little", signed=True)


_PY_INDEX, _PY_WORDS = 16, 20  # CPython's RandomObject: the object header, int index, uint32_t state[624]


def python_mt_reader() -> Callable[[], tuple[bytes, Any]] | None:
    """A reader of Python's global MT19937 from its C struct: ``(its bytes, gauss_next)``, for
    :func:`python_state`; None where the struct is not laid out as read here (checked once
    against ``random.getstate()``, which builds a 625-int tuple: ~17 us a call)."""
    inst = random._inst  # type: ignore[attr-defined]
    try:
        raw = ctypes.string_at(id(inst), _PY_WORDS + _MT_WORDS * 4)
        version, internal, _ = random.getstate()
        if version != 3 or tuple(python_state(raw, None)["state"].tolist()) != internal:
            return None
    except Exception:  # noqa: BLE001 - another Python: random.getstate()
        return None

    view = _memory(id(inst), _PY_WORDS + _MT_WORDS * 4)  # inst lives as long as the random module

    def read() -> tuple[bytes, Any]:
        return view.tobytes(), inst.gauss_next  # type: ignore[attr-defined]
    return read


def python_state(raw: bytes, gauss: Any) -> dict[str, Any]:
    """``get_rng_state()["python"]`` of a struct read by :func:`python_mt_reader`."""
    words = np.empty(_MT_WORDS + 1, dtype=np.uint32)
    words[:_MT_WORDS] = np.frombuffer(raw, dtype="<u4", count=_MT_WORDS, offset=_PY_WORDS)
    words[_MT_WORDS] = int.from_bytes(raw[_PY_INDEX:_PY_INDEX + 4], "little", signed=True)
    return {"version": 3, "state": torch.from_numpy(words), "gauss": gauss}


def python_getstate(state: tuple[Any, ...]) -> dict[str, Any]:
    """``get_rng_state()["python"]`` of a ``random.getstate()`` tuple (where the struct is not read)."""
    version, internal, gauss = state
    # MT19937 words (and the position, <= 624) all fit 32 bits: half the bytes of int64.
    return {"version": version,
            "state": torch.from_numpy(np.fromiter(internal, dtype=np.uint32, count=len(internal))), "gauss": gauss}


PY_MT = python_mt_reader()

_GAUSS = struct.Struct("<Qi4xd")  # aug_bitgen_t: the bitgen_t pointer, int has_gauss, (padding), double gauss


def numpy_gauss_reader() -> Callable[[Any], tuple[int, float] | None] | None:
    """A reader of a legacy ``RandomState``'s Gaussian cache (``has_gauss``, ``gauss``) from its C
    struct (``aug_bitgen_t``: a pointer to the object's own ``bitgen_t``, then ``int has_gauss``,
    then ``double gauss``), about 1 us where ``get_state`` takes 40-100 us. The struct is found in
    a private ``RandomState`` among the pointers into the object itself, as the one whose reading
    agrees with ``get_state`` with and without a cached Gaussian (the global generator is never
    touched); None where not exactly one does (another numpy: the caller uses ``get_state``)."""
    if sys.byteorder != "little":
        return None
    try:
        rs = np.random.RandomState(1)
        base, size = id(rs), type(rs).__basicsize__
        raw = ctypes.string_at(base, size)
        found = [(off, ptr - base) for off in range(0, size - 23, 8)
                 if base <= (ptr := struct.unpack_from("<Q", raw, off)[0]) < base + size]

        def reader(off: int, target: int) -> Callable[[Any], tuple[int, float] | None]:
            last: list[Any] = [None, None]  # the RandomState last read and a view of its struct

            def read(r: Any) -> tuple[int, float] | None:
                if last[0] is not r:  # the view of the struct made once per object (kept alive here)
                    last[:] = [r, _memory(id(r) + off, 24)]
                ptr, has_gauss, gauss = _GAUSS.unpack(last[1].tobytes())
                return (has_gauss, gauss) if ptr == id(r) + target else None  # not this layout: None
            return read

        agree = [reader(off, target) for off, target in found]
        for draw in (0, 1, 2):  # no Gaussian cached, one cached, the cache used
            if draw:
                rs.standard_normal()
            st = rs.get_state(legacy=False)
            agree = [read for read in agree if read(rs) == (st["has_gauss"], st["gauss"])]
    except Exception:  # noqa: BLE001 - another numpy: get_state
        return None
    return agree[0] if len(agree) == 1 else None


NP_GAUSS = numpy_gauss_reader()


def _numpy_fast() -> dict[str, Any] | None:
    """``get_rng_state()["numpy"]`` read from the C structs of numpy's global generator (words and
    position: :func:`numpy_mt`; the Gaussian cache: :func:`numpy_gauss_reader`), where it is the
    legacy ``RandomState`` over an ``MT19937`` (numpy's default); None elsewhere."""
    r = np.random.mtrand._rand  # type: ignore[attr-defined]
    if NP_GAUSS is None or type(r) is not np.random.RandomState or type(r._bit_generator) is not np.random.MT19937:
        return None
    mt, gauss = numpy_mt(), NP_GAUSS(r)
    if mt is None or gauss is None:
        return None
    words, pos = mt
    return {"alg": "MT19937", "keys": torch.frombuffer(bytearray(words), dtype=torch.uint32), "pos": pos,
            "has_gauss": gauss[0], "cached_gaussian": gauss[1]}


def numpy_state() -> dict[str, Any]:
    """``get_rng_state()["numpy"]``: from the structs where they can be read, else ``get_state``.

    numpy's global generator over an MT19937 (the default) gives ``{alg, keys, pos, has_gauss,
    cached_gaussian}``; over another bit generator (``np.random.set_bit_generator``: PCG64,
    PCG64DXSM, Philox, SFC64) ``{alg, state, has_gauss, cached_gaussian}``, ``state`` being its
    bit generator's ``state`` without the name, every integer a decimal string (PCG64's are 128-bit:
    neither JSON readers nor SQLite hold them) and every integer array a list of them.
    """
    fast = _numpy_fast()  # a gradient log takes the RNG state two or three times a step: 1 us, not 40-100
    if fast is not None:
        return fast
    # The dict form: ~30 us less than the legacy tuple (no list of 624 ints); the same values.
    np_state: dict[str, Any] = dict(np.random.get_state(legacy=False))
    alg = np_state.pop("bit_generator")
    has_gauss, gauss = int(np_state.pop("has_gauss")), float(np_state.pop("gauss"))
    if alg == "MT19937":
        keys, pos = np_state["state"]["key"], np_state["state"]["pos"]
        return {"alg": alg, "keys": torch.from_numpy(np.array(keys, dtype=np.uint32)), "pos": int(pos),
                "has_gauss": has_gauss, "cached_gaussian": gauss}
    return {"alg": alg, "state": _portable(np_state, alg), "has_gauss": has_gauss, "cached_gaussian": gauss}


def _portable(value: Any, alg: str, path: str = "state") -> Any:
    """A bit generator's state as JSON and SQLite hold it exactly: integers as decimal strings,
    integer arrays as lists of them; floats and bools as they are."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)):
        return str(int(value))
    if isinstance(value, (float, np.floating)):
        return float(value)
    if isinstance(value, np.ndarray) and value.dtype.kind in "iu":
        return [str(v) for v in value.reshape(-1).tolist()]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: _portable(v, alg, f"{path}.{k}") for k, v in value.items()}
    raise ConfigError(f"numpy's global bit generator {alg} has a state stepdump cannot store exactly "
                      f"({type(value).__name__} at {path}); set one of numpy's own as numpy's global "
                      "generator (np.random.set_bit_generator(np.random.PCG64(seed)): "
                      f"{', '.join(NUMPY_BIT_GENERATORS)})")


def _from_portable(value: Any, path: str = "state") -> Any:
    """Inverse of :func:`_portable`, checking what a damaged store could hold there."""
    if isinstance(value, str):
        if not _INT.fullmatch(value):
            raise CorruptDataError(f"the recorded numpy RNG state holds {value[:40]!r} at {path}, where an integer "
                                   "belongs; the store is damaged")
        return int(value)
    if isinstance(value, list):
        return [_from_portable(v, f"{path}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        return {k: _from_portable(v, f"{path}.{k}") for k, v in value.items()}
    if isinstance(value, (bool, float)):
        return value
    raise CorruptDataError(f"the recorded numpy RNG state holds a {type(value).__name__} at {path}; "
                           "the store is damaged")


_INT = re.compile(r"-?[0-9]{1,80}")  # the longest state integer numpy has is 128 bits: 39 digits

#: numpy's bit generators a restore may create by the name a record gives: nothing else is ever
#: looked up or constructed from a store.
NUMPY_BIT_GENERATORS: dict[str, type[np.random.BitGenerator]] = {
    c.__name__: c for c in (np.random.MT19937, np.random.PCG64, np.random.PCG64DXSM, np.random.Philox,
                            np.random.SFC64)}


def numpy_set_state_arg(n: dict[str, Any]) -> Any:
    """What ``np.random.set_state`` takes for ``get_rng_state()["numpy"]`` ``n``: MT19937's legacy
    tuple, or numpy's dict form of another bit generator's state (its ``get_state(legacy=False)``)."""
    if "keys" in n:
        return (n["alg"], n["keys"].numpy().astype(np.uint32), int(n["pos"]), int(n["has_gauss"]),
                float(n["cached_gaussian"]))
    state = _from_portable(n["state"])
    if not isinstance(state, dict):
        raise CorruptDataError("the recorded numpy RNG state is not a mapping; the store is damaged")
    return {**state, "bit_generator": str(n["alg"]), "has_gauss": int(n["has_gauss"]),
            "gauss": float(n["cached_gaussian"])}


def _set_numpy(n: dict[str, Any], arg: Any) -> None:
    """Set numpy's global generator to record ``n`` (``arg``: its :func:`numpy_set_state_arg`): over
    the recorded bit generator, which replaces the global one where that is another class (a fresh
    process has an MT19937)."""
    alg = str(n["alg"])
    if type(np.random.get_bit_generator()).__name__ != alg:  # type: ignore[attr-defined]
        cls = NUMPY_BIT_GENERATORS.get(alg)
        if cls is None:
            raise RestoreMismatchError(
                f"numpy's RNG state was recorded over the bit generator {alg!r}, which is not one of numpy's "
                f"({', '.join(NUMPY_BIT_GENERATORS)}) and not numpy's global one here: set one of that class "
                "first (np.random.set_bit_generator), or restore with rng=False")
        fresh = cls(0)  # any seed: the recorded state replaces it, set here first so that a state numpy
        # refuses leaves the global generator as it was
        fresh.state = arg if isinstance(arg, dict) else {"bit_generator": alg, "state": {"key": arg[1], "pos": arg[2]}}
        np.random.set_bit_generator(fresh)  # type: ignore[attr-defined]
    np.random.set_state(arg)  # the legacy Gaussian cache too, which is the RandomState's


def raw_rng() -> tuple[Any, ...] | None:
    """Every generator's state as raw bytes (torch's CPU state, numpy's MT19937 words, position and
    Gaussian cache, Python's words and ``gauss_next``, each CUDA device's state), or None where one
    of them is not read raw here (another numpy bit generator, another Python). Two equal readings
    are the same :func:`get_rng_state`: a cheap test of "nothing drew since" (a few reads of
    memory, where building and comparing the dicts is a few dozen calls). Unequal readings may
    still be the same state (say so only after comparing the dicts)."""
    mt = numpy_mt()
    if mt is None or NP_GAUSS is None or PY_MT is None:
        return None
    gauss = NP_GAUSS(np.random.mtrand._rand)  # type: ignore[attr-defined]
    if gauss is None:
        return None
    words, gauss_next = PY_MT()
    try:  # inside a torch.func transform the states come back as wrapped tensors, with no bytes to read
        cuda = tuple(s.numpy().tobytes() for s in torch.cuda.get_rng_state_all()) if torch.cuda.is_initialized() \
            else ()
        cpu = torch.default_generator.get_state().numpy().tobytes()
    except RuntimeError:
        return None
    # Python's words from its index on: the bytes before it are the object's header (its refcount).
    return (cpu, mt[0], mt[1], gauss, words[_PY_INDEX:], gauss_next, cuda)


def raw_of(state: dict[str, Any]) -> tuple[Any, ...] | None:
    """:func:`raw_rng`'s reading of the state ``state`` (a :func:`get_rng_state` result), made from
    its tensors: equal to what :func:`raw_rng` read at the moment ``state`` was taken (a cheap
    "nothing drew since" against it). None where ``state`` holds another numpy bit generator or
    tensors with no bytes to read (inside a ``torch.func`` transform)."""
    n, p = state["numpy"], state["python"]
    if "keys" not in n:
        return None
    try:
        words = p["state"].numpy()  # Python's 624 words, then its index (python_state)
        return (state["torch"].numpy().tobytes(), n["keys"].numpy().tobytes(), int(n["pos"]),
                (int(n["has_gauss"]), float(n["cached_gaussian"])), words[_MT_WORDS:].tobytes() +
                words[:_MT_WORDS].tobytes(), p["gauss"], tuple(c.numpy().tobytes() for c in state.get("cuda") or ()))
    except RuntimeError:
        return None


def get_rng_state() -> dict[str, Any]:
    """Torch CPU, every CUDA device (when present), numpy's global and Python's ``random``."""
    numpy = numpy_state()
    python = python_state(*PY_MT()) if PY_MT is not None else python_getstate(random.getstate())
    # (torch.get_rng_state() without its wrapper; CUDA initialised implies available, and
    # is_available() is three Python calls on a CPU-only run: this is read at every gradient-log step)
    state: dict[str, Any] = {"torch": torch.default_generator.get_state(), "numpy": numpy, "python": python}
    if torch.cuda.is_initialized():
        state["cuda"] = list(torch.cuda.get_rng_state_all())
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Inverse of :func:`get_rng_state`."""
    numpy = numpy_set_state_arg(state["numpy"])  # a damaged record is refused before anything is set
    torch.set_rng_state(state["torch"].to(torch.uint8))
    _set_numpy(state["numpy"], numpy)
    p = state["python"]
    random.setstate((p["version"], tuple(int(v) for v in p["state"].tolist()), p["gauss"]))
    cuda = state.get("cuda")
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([c.to(torch.uint8) for c in cuda])


def same_rng_state(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two :func:`get_rng_state` results are the same state of every generator."""
    if a.keys() != b.keys() or not torch.equal(a["torch"], b["torch"]):
        return False
    na, nb = a["numpy"], b["numpy"]
    pa, pb = a["python"], b["python"]
    if (na["alg"], na["has_gauss"], na["cached_gaussian"]) != (nb["alg"], nb["has_gauss"], nb["cached_gaussian"]):
        return False
    if "keys" in na or "keys" in nb:  # MT19937's words (another bit generator's state: plain JSON values)
        if not ("keys" in na and "keys" in nb and na["pos"] == nb["pos"] and torch.equal(na["keys"], nb["keys"])):
            return False
    elif na["state"] != nb["state"]:
        return False
    if (pa["version"], pa["gauss"]) != (pb["version"], pb["gauss"]) or not torch.equal(pa["state"], pb["state"]):
        return False
    ca, cb = a.get("cuda") or [], b.get("cuda") or []
    return len(ca) == len(cb) and all(torch.equal(x, y) for x, y in zip(ca, cb))


class ForwardRng:
    """Sets the RNG recorded at each training forward of an iteration (state ``forward_rng``) at
    the same forward of a re-run: the model's forward pre-hook, grad enabled, in order.

    A re-run handed the recorded batch does not redo the draws the loop made between the start of
    the iteration and a forward (nanoGPT's ``get_batch``, an augmentation), so without this each
    forward's dropout would draw other numbers. ``seen`` counts the training forwards of the last
    iteration; ``matched`` says whether they were as many as recorded (every one replayed).
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self._states: list[dict[str, Any]] = []
        self.seen = 0
        # prepend: before the user's own pre-hooks, as the Recorder's hook saw the RNG before them
        self._handle = model.register_forward_pre_hook(self._pre, prepend=True)

    def start(self, states: list[dict[str, Any] | None] | None, start: dict[str, Any] | None = None) -> None:
        """An iteration begins: its recorded forward RNG states (None or empty: none to set). An
        entry None is "the iteration's start state" (nothing drew before that forward): ``start``."""
        resolved = [start if s is None else s for s in states or []]
        self._states = [s for s in resolved if s is not None]
        if len(self._states) != len(resolved):  # a None with no start to stand for: none can be set
            self._states = []
        self.seen = 0

    @property
    def matched(self) -> bool:
        return bool(self._states) and self.seen == len(self._states)

    def _pre(self, module: torch.nn.Module, args: Any) -> None:
        if not torch.is_grad_enabled():
            return
        if self.seen < len(self._states):
            set_rng_state(self._states[self.seen])
        self.seen += 1

    def remove(self) -> None:
        self._handle.remove()
