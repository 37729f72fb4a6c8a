"""Loaded by every Python process of a launch whose PYTHONPATH starts with this folder: any name lookup or
connection to a host off this machine is written to $ASTRAI_NETWORK_LOG and refused, so a test can assert
that a run never tried to reach the network (no hub, no telemetry) without sending anything."""

import os
import socket

_LOG = os.environ.get("ASTRAI_NETWORK_LOG")
_LOCAL = {None, "", "localhost", "ip6-localhost", "::1", "0.0.0.0", socket.gethostname()}


def _is_local(host) -> bool:
    host = host.decode() if isinstance(host, bytes) else host
    return host in _LOCAL or str(host).startswith("127.")


def _refuse(host, what: str):
    with open(_LOG, "a") as log:
        log.write(f"{os.getpid()} {what} {host}\n")
    raise OSError(f"network spy: {what} {host} refused (the test forbids leaving this machine)")


if _LOG:
    with open(_LOG + ".pids", "a") as loaded:  # proof the spy ran in this process
        loaded.write(f"{os.getpid()}\n")
    _getaddrinfo, _connect = socket.getaddrinfo, socket.socket.connect

    def getaddrinfo(host, *args, **kwargs):
        if not _is_local(host):
            _refuse(host, "lookup")
        return _getaddrinfo(host, *args, **kwargs)

    def connect(self, address):
        if isinstance(address, tuple) and not _is_local(address[0]):
            _refuse(address[0], "connect")
        return _connect(self, address)

    socket.getaddrinfo, socket.socket.connect = getaddrinfo, connect
