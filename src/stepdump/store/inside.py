"""Every path a store touches lies inside its run directory, reached through no link.

A run directory may come from someone else (a shared file system, a tarball, a bundle) and
hold links planted in it. A joint run's pair directories, a multi-rank run's rank directories,
its layout files (``joint.json``, ``ranks.json``) and the temporary files they are written
under are names inside the run, never a way to another store: a link among them would aim a
Recorder's writes (building or appending to a store, overwriting a file) or a reader's reads
(another run's tensors, returned as this run's) at something outside it. So each goes through
this module:

* :func:`inside`: ``root / rel`` once no part of ``rel`` is a symbolic link (``lstat``, part by
  part) and, what is there, of the kind expected; else :class:`CorruptDataError` naming it;
* :func:`make_dir`: a directory of the run (a pair's or a rank's store), created if missing;
* :func:`read_file`: a small file of the run (a layout file), opened with ``O_NOFOLLOW``;
* :func:`write_atomic`: a small file written under a fresh temporary name created with
  ``O_CREAT | O_EXCL | O_NOFOLLOW`` (a planted name is never opened), then renamed over.

A reader's segment files go through :func:`inside` too (``storage.py``), and so does
``segments/`` before a Recorder writes (``catalog.check_writable_layout``); the writer opens
each segment folder by folder with ``O_NOFOLLOW`` and the catalog's files with
``plainfile.open_plain``. The run directory itself is the caller's: a link *to* it is
followed, as any path given.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
from pathlib import Path

from stepdump.errors import CorruptDataError
from stepdump.store.plainfile import describe, open_plain, refusal


def _parts(rel: str) -> list[str]:
    parts = rel.split("/")
    if not rel or rel.startswith("/") or "\x00" in rel or any(p in ("", ".", "..") for p in parts):
        raise CorruptDataError(f"refusing {rel!r}: it would leave the run directory")
    return parts


def inside(root: str | os.PathLike[str], rel: str, role: str, *, kind: str = "directory") -> Path:
    """``root / rel``, refused unless every part of ``rel`` that exists is a plain directory (the
    last one: a ``kind``, "directory" or "file") and none is a symbolic link.

    Args:
        root: The run directory (followed if it is a link: it is the caller's path).
        rel: A relative path inside it, ``/``-separated (``"G"``, ``"rank00003"``).
        role: What stepdump keeps there, for the error message ("pair 'G''s store").
        kind: What the last part must be where it exists.

    Raises:
        CorruptDataError: a part is a link, or not what stepdump keeps there.
    """
    base = Path(root)
    parts = _parts(rel)
    path = base
    for i, part in enumerate(parts):
        path = path / part
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return base.joinpath(*parts)
        except NotADirectoryError:
            raise refusal(path.parent, "a file", role, "a directory") from None
        want = kind if i == len(parts) - 1 else "directory"
        ok = stat.S_ISDIR(st.st_mode) if want == "directory" else stat.S_ISREG(st.st_mode)
        if not ok:
            what = describe(st)
            if stat.S_ISLNK(st.st_mode):
                what += " (it could lead outside the run directory)"
            raise refusal(path, what, role, "a directory" if want == "directory" else "a regular file")
    return path


def make_dir(root: str | os.PathLike[str], name: str, role: str) -> Path:
    """The run's directory ``name`` (created if missing, with ``root``): a directory, not a link."""
    Path(root).mkdir(parents=True, exist_ok=True)
    path = inside(root, name, role)
    try:
        os.mkdir(path, 0o755)
    except FileExistsError:
        pass
    return inside(root, name, role)  # a link made meanwhile is refused here


def read_file(root: str | os.PathLike[str], name: str, role: str, max_bytes: int) -> bytes:
    """The bytes of the run's small file ``name``, at most ``max_bytes + 1`` of them (so a caller
    can tell a file too large), opened without following a link or blocking on a FIFO.

    Raises:
        FileNotFoundError: there is no such file.
        CorruptDataError: it is a link, a FIFO, a directory or a device.
    """
    path = inside(root, name, role, kind="file")
    fd = open_plain(path, os.O_RDONLY, role, single_link=False)
    with os.fdopen(fd, "rb") as f:
        return f.read(max_bytes + 1)


def write_atomic(root: str | os.PathLike[str], name: str, data: bytes, role: str) -> None:
    """Write the run's small file ``name`` atomically: into a temporary file of a fresh random name
    created exclusively (``O_EXCL | O_NOFOLLOW``: whatever is planted under a name is never
    opened, so never written through), then renamed over ``name`` (a rename replaces a link
    itself, never its target)."""
    base = Path(root)
    base.mkdir(parents=True, exist_ok=True)
    _parts(name)
    dir_fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for _ in range(100):
            tmp = f".{name}.{os.getpid()}.{secrets.token_hex(6)}.tmp"
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644,
                             dir_fd=dir_fd)
            except FileExistsError:
                continue
            break
        else:  # 100 random names all taken: someone is filling the directory
            raise CorruptDataError(f"cannot write {base / name}: no free temporary name in {base}")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:
            try:
                os.unlink(tmp, dir_fd=dir_fd)
            except OSError as e:
                if e.errno != errno.ENOENT:
                    raise
            raise
    finally:
        os.close(dir_fd)
