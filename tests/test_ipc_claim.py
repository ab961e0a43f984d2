"""An ipc endpoint's claim where it cannot be taken: no ``flock`` (Lustre mounted -o noflock)
or a folder where no lock file can be made. The service then serves unclaimed, as before the
claim existed, leaves no lock file behind and never raises at its stop."""

from __future__ import annotations

import errno
import os
import socket

import pytest
from entrain_data.workers import ipc_claim

from entrain_data.errors import AddressInUse


def _listen(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)
    s.listen()
    return s


def test_a_claim_is_exclusive_and_its_release_removes_both_files(tmp_path):
    ep = f"ipc://{tmp_path}/svc.sock"
    fd = ipc_claim.claim(ep)
    assert fd is not None and (tmp_path / "svc.sock.lock").exists()
    with pytest.raises(AddressInUse, match="is in use"):
        ipc_claim.claim(ep)
    sock = _listen(str(tmp_path / "svc.sock"))
    try:
        ipc_claim.remove_unclaimed(ep)  # another process's stop: the live one's files stay
        assert (tmp_path / "svc.sock").exists() and (tmp_path / "svc.sock.lock").exists()
        ipc_claim.release(ep, fd)
    finally:
        sock.close()
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("code", [errno.ENOLCK, errno.ENOSYS])
def test_where_flock_fails_nothing_is_claimed_and_no_lock_file_stays(tmp_path, monkeypatch, code):
    """The lock file was made, then left behind at every stop (ENOSYS also failed the start)."""

    def no_flock(fd, op):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(ipc_claim.fcntl, "flock", no_flock)
    ep = f"ipc://{tmp_path}/svc.sock"
    assert ipc_claim.claim(ep) is None
    assert os.listdir(tmp_path) == []
    _listen(str(tmp_path / "svc.sock")).close()
    ipc_claim.release(ep, None)
    assert os.listdir(tmp_path) == []


def test_a_folder_where_no_lock_file_can_be_made_is_left_to_the_bind(tmp_path, monkeypatch):
    """A read-only folder: the start failed with a bare OSError (a traceback from the CLI) and
    the stop raised it again, leaving the service's own ipc folder behind."""
    real = os.open

    def read_only(path, flags, *args):
        if str(path).endswith(".lock") and flags & os.O_CREAT:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)
        return real(path, flags, *args)

    monkeypatch.setattr(ipc_claim.os, "open", read_only)
    ep = f"ipc://{tmp_path}/svc.sock"
    assert ipc_claim.claim(ep) is None
    _listen(str(tmp_path / "svc.sock")).close()  # a socket file there: the stop removes it
    ipc_claim.remove_unclaimed(ep)  # and never raises
    assert os.listdir(tmp_path) == []
