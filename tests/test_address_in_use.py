"""A service's bind on a taken address fails typed: :class:`AddressInUse`, not words to match.

The Ray service actor re-picks a port another process took between its pick and the bind; it
used to recognise that case by comparing the error's text with the words ``open_sockets``
wrote, so a reworded message would have silently ended the retries."""

from __future__ import annotations

import pytest
import zmq
from entrain_data.workers.config import ServiceConfig
from entrain_data.workers.ray_service import _taken
from entrain_data.workers.sockets import open_sockets

from entrain_data import errors
from entrain_data.errors import InvalidInput, error_fields, error_from_fields

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def zmq_ctx():
    ctx = zmq.Context()
    yield ctx
    ctx.term()


def test_binding_a_port_in_use_raises_address_in_use(tmp_path, zmq_ctx):
    busy = zmq_ctx.socket(zmq.ROUTER)
    busy.setsockopt(zmq.LINGER, 0)
    try:
        port = busy.bind_to_random_port("tcp://127.0.0.1")
        ep = f"tcp://127.0.0.1:{port}"
        cfg = ServiceConfig(
            plan_json="{}",
            endpoint=ep,
            worker_endpoint=f"ipc://{tmp_path}/workers.sock",
            source=None,  # open_sockets binds; it never reads the source
        )
        with pytest.raises(errors.AddressInUse) as raised:
            open_sockets(zmq_ctx, cfg)
    finally:
        busy.close(linger=0)
    exc = raised.value
    assert isinstance(exc, InvalidInput)  # the CLI's one line and exit 2, as before
    assert str(exc) == f"cannot serve on {ep}: address already in use"  # the words users see
    assert exc.endpoint == ep
    back = error_from_fields(error_fields(exc))  # as it reaches the parent's handle or Ray's driver
    assert type(back) is errors.AddressInUse and str(back) == str(exc)


def test_only_a_picked_endpoint_found_taken_is_picked_again():
    ep = "tcp://127.0.0.1:5555"
    picked = {"endpoint": ep}
    assert _taken(errors.AddressInUse(f"cannot serve on {ep}: x", endpoint=ep), picked) == ep
    named = "tcp://127.0.0.1:6000"  # a port the caller named is theirs: never re-picked
    assert _taken(errors.AddressInUse("taken", endpoint=named), picked) is None
    # the type, not the words: an error that merely reads alike is no taken port
    assert _taken(InvalidInput(f"cannot serve on {ep}: address already in use"), picked) is None
