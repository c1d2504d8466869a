"""Free loopback ports for servers and rendezvous started by tests."""

import socket
import time


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for_port(port: int, timeout: float, host: str = "127.0.0.1") -> None:
    """Block until something accepts connections on ``host:port``; raise ``TimeoutError`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"nothing listened on {host}:{port} within {timeout:.0f} s") from None
            time.sleep(0.1)
