"""Private directories that outlive no process using them, even one killed with SIGKILL.

A service's ipc sockets, a rank's data socket and the workers' shared-memory segments
live in directories this package makes (in the temp dir, ``/tmp``, ``/dev/shm``). A
process that ends normally removes its own; one killed with SIGKILL (an OOM kill, a
job scheduler's timeout) cannot. So each directory holds a lock file, ``.owner``,
that every process using the directory holds a shared ``flock`` on for as long as it
lives (the kernel drops it however the process ends), and whoever next makes a
directory of that kind removes those nobody holds (:func:`remove_orphaned_dirs`).
A lock, not a pid check: a process in another container that shares the folder has a
pid this one cannot see.

Names are ``{prefix}{pid}-{random}``: the pid of the process that made the directory,
for :func:`remove_orphaned_dirs`'s ``pid`` filter and for a reader of ``ls``.

A process started to use the directory gets the maker's lock with it (:func:`hold_in_child`):
had it taken its own only once its interpreter ran, a maker killed with SIGKILL in between
would leave the directory held by nobody, and a sweep would remove it under a live process.

On a filesystem without ``flock`` (Lustre mounted without ``-o flock``) a directory is made
without its lock file, with a warning: what a process killed there leaves stays behind, as
no sweep removes a directory whose owner it cannot tell. It holds :data:`_MARK` instead, so
it is never empty.

Removal (a drop or a sweep) takes the lock file last (:func:`_remove_tree`): a directory of
ours with contents has it, so whatever a remover killed midway or raced by a writer (a
worker adding a segment while its coordinator stops) leaves, a sweep can judge. Only an
empty one lacks it (a remover killed in the instant between that unlink and the ``rmdir``):
a sweep removes those once untouched for :data:`_STALE_S`, as no live directory of ours is
ever empty and lockless (made with the lock file or :data:`_MARK`, removed only when dropped).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import glob
import logging
import os
import shutil
import stat
import tempfile
import time
from multiprocessing import reduction
from typing import Any

__all__ = [
    "drop_owned_dir",
    "hold_in_child",
    "hold_owned_dir",
    "make_owned_dir",
    "remove_orphaned_dirs",
]

log = logging.getLogger(__name__)

# what flock raises on a filesystem that has none (Lustre without -o flock: ENOSYS; some NFS)
NO_FLOCK = frozenset({errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL, errno.ENOSYS})
_NEW = ".new-"  # put before the prefix of a directory being made: not yet locked
# a directory still being made, or left empty without its lock file, this long after it was
# last touched was left by a killed maker or remover: making or removing one takes a
# millisecond, and a sweep of younger ones could race a live maker (or a remover's retry)
_STALE_S = 600.0
_OWNER = ".owner"
_MARK = ".no-flock"  # in a directory made where flock fails: never empty, so never swept
# passes of a removal before it leaves the directory, lock file kept, to the next sweep: a
# writer of ours (a worker as its service stops) adds a file or two, not one every pass
_REMOVE_PASSES = 50
_HELD: dict[str, int] = {}  # this process's directories -> the descriptor holding the lock


def make_owned_dir(root: str, prefix: str) -> str:
    """A new directory ``root/{prefix}{pid}-{random}`` this process holds; first removes the
    ones of ``prefix`` in ``root`` that nobody holds any more. Where ``root`` has no ``flock``
    it is made unheld, without a lock file (see the module's docstring)."""
    remove_orphaned_dirs(root, prefix)
    tmp = tempfile.mkdtemp(prefix=f"{_NEW}{prefix}", dir=root)
    fd: int | None = None
    try:
        fd, why = _lock_new(os.path.join(tmp, _OWNER))
        # renamed only once locked: a sweep never sees it unlocked while this process lives
        tail = os.path.basename(tmp)[len(_NEW) + len(prefix) :]
        path = os.path.join(root, f"{prefix}{os.getpid()}-{tail}")
        os.rename(tmp, path)
    except BaseException:
        if fd is not None:
            os.close(fd)
        _remove_tree(tmp)
        raise
    if fd is None:
        log.warning(
            "%s: made without its lock file, as %s has no flock (%s): if this process is "
            "killed with SIGKILL the folder stays behind (mount with -o flock, or use another "
            "folder, to have the next process remove it)",
            path,
            root,
            why,
        )
    else:
        _HELD[path] = fd
    return path


def _lock_new(owner: str) -> tuple[int | None, str]:
    """A descriptor holding a shared lock on the new lock file ``owner``; ``(None, why)`` where
    the filesystem has no ``flock``, the file then replaced by :data:`_MARK`: no sweep judges
    that directory (a host where flock works would find the lock file unheld)."""
    fd = os.open(owner, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
    except OSError as exc:
        os.close(fd)
        if exc.errno not in NO_FLOCK:
            raise
        os.unlink(owner)
        _touch(os.path.join(os.path.dirname(owner), _MARK))
        return None, exc.strerror or str(exc)
    return fd, ""


def _touch(path: str) -> None:
    os.close(os.open(path, os.O_CREAT | os.O_RDWR, 0o600))


def hold_owned_dir(path: str) -> bool:
    """Hold ``path`` (made by :func:`make_owned_dir` in another process, such as the parent
    that started this service) for as long as this process lives; False if it is not one."""
    if path in _HELD:
        return True
    try:
        fd = os.open(os.path.join(path, _OWNER), os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
    except OSError as exc:
        os.close(fd)
        if exc.errno in NO_FLOCK:
            return False
        raise
    _HELD[path] = fd
    return True


class _Handoff:
    """Pickled while a child process is started, this process's lock descriptor goes with it
    (multiprocessing passes it as it passes a ``Pipe`` end: the same open file, so the same
    ``flock``); unpickled in the child, it becomes the child's hold. Never ``LOCK_UN`` it:
    that would release the maker's hold too (closing a descriptor releases nothing while
    another refers to the open file)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        fd = _HELD.get(self.path)
        return _adopt, (self.path, None if fd is None else reduction.DupFd(fd))


def _adopt(path: str, dup: Any) -> str:
    """The child's side of :class:`_Handoff`: keep the descriptor as this process's hold."""
    if dup is not None:
        fd = dup.detach()
        os.set_inheritable(fd, False)  # held by this process only, not by what it execs
        if path in _HELD:
            os.close(fd)
        else:
            _HELD[path] = fd
    return path


def hold_in_child(path: str) -> Any:
    """An argument for a ``multiprocessing`` process being started (spawn or forkserver) that
    makes it hold ``path``, which this process made or holds, from the moment it exists: so a
    sweep never finds the directory unheld while the child lives, even if this process is
    killed before the child runs a line. The child receives ``path`` itself. (Under ``fork``
    nothing is pickled: the child gets this object, and holds the lock through the descriptor
    it inherited.)"""
    return _Handoff(path)


def drop_owned_dir(path: str) -> None:
    """Remove a directory this process made or holds, and let go of its lock. Where a process
    keeps adding files to it, it stays with its lock file: the next sweep removes it."""
    try:
        _remove_tree(path)
    finally:  # the lock goes even if interrupted: a sweep may then finish the removal
        fd = _HELD.pop(path, None)
        if fd is not None:
            os.close(fd)


def remove_orphaned_dirs(root: str, prefix: str, pid: int | None = None) -> list[str]:
    """Remove the directories of ``prefix`` in ``root`` that no live process holds (only
    those ``pid`` made, when given); the removed paths. Folders without the lock file (a
    user's, an older release's, one made where flock fails) are left alone, unless empty and
    untouched for :data:`_STALE_S` (what a remover killed midway left). Without ``pid``, a
    directory a maker killed mid-way left (``.new-{prefix}*``, as old) goes too."""
    removed = [] if pid is not None else _remove_stale_new(root, prefix)
    for path in glob.glob(os.path.join(glob.escape(root), f"{glob.escape(prefix)}*-*")):
        owner = os.path.basename(path)[len(prefix) :].split("-", 1)[0]
        if not owner.isdigit() or (pid is not None and int(owner) != pid):
            continue
        if _remove_unheld(path, half_made=False):
            removed.append(path)
    return removed


def _remove_stale_new(root: str, prefix: str) -> list[str]:
    """The half-made directories of ``prefix`` (killed between ``mkdtemp`` and the rename that
    names it, so no pid and maybe no lock file) old enough that no live maker has them,
    unless one is held."""
    removed = []
    for path in glob.glob(os.path.join(glob.escape(root), f"{glob.escape(_NEW + prefix)}*")):
        try:
            if time.time() - os.stat(path).st_mtime < _STALE_S:
                continue
        except OSError:  # gone meanwhile (renamed by its maker, or swept by another)
            continue
        if _remove_unheld(path, half_made=True):
            removed.append(path)
    return removed


def _remove_unheld(path: str, half_made: bool) -> bool:
    """Remove ``path`` unless a live process holds its lock file, locking it meanwhile so nobody
    takes it up; whether it is gone. Without a lock file a half-made directory goes (its age
    checked by the caller), a named one only as :func:`_remove_left_empty` says."""
    try:
        fd: int | None = os.open(os.path.join(path, _OWNER), os.O_RDONLY)
    except FileNotFoundError:
        if not half_made:
            return _remove_left_empty(path)
        fd = None
    except OSError:  # not ours to read
        return False
    if fd is not None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held (a process using it is alive), or no flock: owner unknown
            os.close(fd)
            return False
    try:  # removed while locked: nobody can take it up meanwhile
        return _remove_tree(path)
    finally:
        if fd is not None:
            os.close(fd)


def _remove_left_empty(path: str) -> bool:
    """Remove ``path``, named but without its lock file, if it is empty and untouched for
    :data:`_STALE_S`: a remover's leftover (see the module's docstring). One with contents may
    be live where flock fails, or a user's: not judged."""
    try:
        if time.time() - os.stat(path).st_mtime < _STALE_S:
            return False  # maybe a remover's between its last two steps, or a user's new one
        os.rmdir(path)  # fails if anything is in it: checked and removed in one step
    except OSError:
        return False
    return True


def _remove_tree(path: str) -> bool:
    """Remove ``path``, its lock file last; whether it is gone.

    ``shutil.rmtree`` lists the folder, unlinks what it listed (the lock file too), then
    ``rmdir`` fails, silently, on a file written meanwhile (a worker's new segment while its
    coordinator stops): the writer later unlinks it and leaves an empty folder without a lock
    file, that no sweep would judge. Here everything else goes first, listed again until
    nothing is left; only then the lock file, and if a file came in before the ``rmdir``, the
    lock file is made again and the removal goes on. Left (a writer that never stops, an entry
    it cannot remove) it keeps its lock file, for the next sweep once nobody holds it.
    """
    owner = os.path.join(path, _OWNER)
    for _ in range(_REMOVE_PASSES):
        try:
            names = os.listdir(path)
        except FileNotFoundError:
            return True
        except OSError:
            return False
        others = [n for n in names if n != _OWNER]
        for name in others:
            _remove_entry(os.path.join(path, name))
        if others:
            continue  # listed again: a writer may have added more meanwhile
        with contextlib.suppress(FileNotFoundError):  # or another remover's, at the same time
            if names:
                os.unlink(owner)
        try:
            os.rmdir(path)
            return True
        except FileNotFoundError:
            return True
        except OSError as exc:
            if names:  # not empty, or not ours to remove: never without its lock file
                with contextlib.suppress(OSError):  # unless gone meanwhile
                    _touch(owner)
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                return False
    return False


def _remove_entry(path: str) -> None:
    """Remove a file, socket or folder in a directory being removed; what fails stays, for
    the caller's next pass (or its lock file keeps it for a sweep)."""
    with contextlib.suppress(OSError):
        if stat.S_ISDIR(os.lstat(path).st_mode):
            shutil.rmtree(path, ignore_errors=True)
        else:
            os.unlink(path)
