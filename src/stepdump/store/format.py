"""Constants of the store format (see FORMAT.md); torch-free (dtypes are names here,
see :mod:`stepdump.core.dtypes` for the torch mapping).

``FORMAT_VERSION`` changes only when a reader of the previous version could no
longer read a store correctly; it is independent of the package version.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable

# The newest format this stepdump reads and writes. A new store is format 1 (xxh3 fingerprints
# only, the format every earlier stepdump reads); it becomes format 2 in the transaction that
# gives its first series a fingerprint kind other than xxh3 (the fp_kinds table, FORMAT.md), and
# format 3 in the transaction that commits its first stat chunk (stats-only rows stored as columns,
# the stat_chunks table; a format-3 catalog has both tables).
FORMAT_VERSION = 3
FIRST_FORMAT_VERSION = 1  # what a new catalog is created as
READABLE_FORMAT_VERSIONS = (1, 2, 3)
FP_KINDS_FORMAT_VERSION = 2  # the first format with the fp_kinds table
STAT_CHUNKS_FORMAT_VERSION = 3  # the first format with the stat_chunks table
# Fingerprint kinds (FORMAT.md, "Fingerprint kinds"): xxh3-64 of the raw bytes (every series of
# a format-1 store) and dmix64, the order-free sum a device computes (core/device_lean.py).
FP_KIND_XXH3 = "xxh3"
FP_KIND_DMIX64 = "dmix64"
KNOWN_FP_KINDS = (FP_KIND_XXH3, FP_KIND_DMIX64)
CATALOG_FILE = "catalog.sqlite"
SEGMENT_DIR = "segments"
LOCK_FILE = "LOCK"

# Raw tensor bytes are little-endian; a big-endian writer would have to swap.
if sys.byteorder != "little":  # pragma: no cover - no such machine in CI
    raise ImportError("stepdump's store is little-endian; big-endian hosts are not supported yet")

# Kinds of recorded tensors. ``buffers`` come with ``params``; ``state`` holds the
# tensors found inside RNG / scheduler / scaler / optimizer-extra state; ``extra`` those of the
# objects given as ``Recorder(extra_state=)`` (an EMA), named ``<name>/<path>``.
TENSOR_KINDS = ("params", "grads", "optimizer", "activations", "activation_grads", "inputs")
INTERNAL_KINDS = ("buffers", "state", "extra")
# The step state's key holding the typed JSON of the extra state (FORMAT.md).
STATE_EXTRA = "extra_state"
# What a re-execution captured and wrote back into the run (``reexecute(write_back=True)``):
# kinds of their own, so that no reader takes them for what the recording captured.
REEXEC_KINDS = ("reexec_activations", "reexec_activation_grads")
# The meta key holding each written-back re-execution's verdict and evidence, by step (FORMAT.md).
META_REEXECUTIONS = "reexecutions"
ALL_KINDS = TENSOR_KINDS + INTERNAL_KINDS + REEXEC_KINDS
#: A series, as the catalog names it: (kind, name), e.g. ``("grads", "fc1.weight")``.
Key = tuple[str, str]

# Step levels in the catalog.
LEVEL_NONE = 0  # only the step row and its scalars
LEVEL_STATS = 1  # stats and fingerprints, no tensor bytes
LEVEL_FULL = 2  # stats, fingerprints and tensor bytes

# A record's state key: the params changed outside the optimizer since the previous update (stored
# at that step; a gradient log's rebuild takes them instead of the update's output).
STATE_OUTSIDE_OPTIMIZER = "outside_optimizer"
# Beside it: what the previous update left in those params (name -> exact xxh3 fingerprint), so a
# re-execution of that update compares with the update's output, not with the loop's edit.
STATE_AFTER_UPDATE = "after_update"
# A full record's state key: the params whose grad was carried into the iteration (not written by its
# backward: a zero grad kept by zero_grad(set_to_none=False), a grad nobody zeroes); restore sets them
# to the record's grads, as the optimizer found them (capture/carried.py).
STATE_CARRIED_GRADS = "carried_grads"
# A record's state key: the RNG state at each training forward of the iteration (the model's forward
# pre-hook, grad enabled), in order; re-execution and replay set it there (draws between the
# iteration's start and a forward: nanoGPT's get_batch, augmentation).
STATE_FORWARD_RNG = "forward_rng"


# A sparse COO tensor (FORMAT.md, "Sparse tensors"): its ``tensors.dtype`` is this prefix and
# the dtype of its values ("sparse_coo:float32"), ``shape`` its dense size, and its raw bytes
# a 32-byte header, the int64 indices and the values, exactly as the tensor held them.
SPARSE_COO_PREFIX = "sparse_coo:"
SPARSE_COO_MAGIC = b"COO1"
SPARSE_COO_HEADER = "<4sIQQQ"  # magic, flags (bit 0: coalesced), sparse_dim, nnz, reserved (0)
SPARSE_COO_HEADER_BYTES = 32
SPARSE_COO_COALESCED = 1
# The kinds whose sparse COO tensors are stored sparse; a sparse tensor of another kind (SGD's
# momentum of sparse grads) is stored dense, ``to_dense()`` (its exact form is in the step's state).
SPARSE_KINDS = ("grads",)


def sparse_values_dtype(dtype: str) -> str | None:
    """The values' dtype name of a sparse COO row's ``dtype`` column; None for a dense row."""
    return dtype[len(SPARSE_COO_PREFIX):] if dtype.startswith(SPARSE_COO_PREFIX) else None


def parse_shape(text: str) -> tuple[int, ...]:
    """Parse the catalog's shape column ("" for a 0-d tensor, else "2,3")."""
    return tuple(int(p) for p in text.split(",")) if text else ()


def format_shape(shape: Iterable[int]) -> str:
    return ",".join(str(int(d)) for d in shape)
