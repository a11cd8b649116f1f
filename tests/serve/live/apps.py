"""What the live-server tests share besides their fixtures (conftest.py): a free loopback port,
the worker hook that stands 127.0.0.2 in for a public host, apps deployed for as long as a block
runs, and the JSON schema the structured-output tests of every family ask for."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator

from ray import serve

from areno.serve.app import build_app
from areno.serve.config import ServeConfig

# A second loopback address that every Ray worker of the tests treats as a public host, so that a
# redirect from an allowed-looking server to a private address is tested end to end. No other
# test sends anything to it: the other apps see every address as before.
PUBLIC_STAND_IN = "127.0.0.2"

PET_SCHEMA = {
    "type": "object",
    "properties": {
        "label": {"enum": ["cat", "dog"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["label", "count"],
    "additionalProperties": False,
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def public_stand_in() -> None:
    """Ray worker setup hook: PUBLIC_STAND_IN counts as a public address, every other check
    stays. Workers cannot import the tests package, so the hook travels by value."""
    import ipaddress

    from areno.media import remote

    original, stand_in = remote.is_public_address, ipaddress.ip_address(PUBLIC_STAND_IN)
    remote.is_public_address = lambda ip: ip == stand_in or original(ip)


@contextlib.contextmanager
def deployed(*apps: tuple[str, str, ServeConfig]) -> Iterator[None]:
    """Each (name, route prefix, config) app in the running Serve instance while the block runs,
    then deleted (its replicas stopped, their CPUs given back for the next module's apps). The
    apps start one after another: on two cores a second engine compiling beside the first only
    slows both, and it finds the first one's compiled steps in the cache once that has finished."""
    started: list[str] = []
    try:
        for name, prefix, config in apps:
            started.append(name)
            serve.run(build_app(config), name=name, route_prefix=prefix)
        yield
    finally:
        for name in reversed(started):
            serve.delete(name)
