"""PrometheusGauges: serve a few figures over HTTP for Prometheus to scrape, each from its first value on."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any


class PrometheusGauges:
    """An HTTP endpoint with one gauge ``memopt_<name>`` per name, in a registry of its own.

    A gauge appears with its first value: before it, none (rather than a 0 that was never measured).
    Figures of other names are ignored. :meth:`close` shuts the server down, so the port can be
    served again in the same process. Needs ``prometheus_client``.

    Args:
        names: the figures served.
        address: the interface to listen on (``"127.0.0.1"``: this machine only).
        port: the TCP port.

    Raises:
        OSError: when the port cannot be bound (in use, or the address is not this machine's).

    Example::

        >>> import socket, urllib.request
        >>> with socket.socket() as probe:
        ...     _ = probe.bind(("127.0.0.1", 0)); port = probe.getsockname()[1]
        >>> gauges = PrometheusGauges(["peak_allocated_gb"], "127.0.0.1", port)
        >>> gauges.set({"peak_allocated_gb": 1.5, "unserved": 2.0})
        >>> body = urllib.request.urlopen(gauges.url, timeout=10).read().decode()
        >>> [line for line in body.splitlines() if line.startswith("memopt_")]
        ['memopt_peak_allocated_gb 1.5']
        >>> gauges.close()
    """

    def __init__(self, names: Iterable[str], address: str, port: int) -> None:
        import prometheus_client

        self._registry = prometheus_client.CollectorRegistry()
        self._gauges: dict[str, Any] = dict.fromkeys(names)
        server = prometheus_client.start_http_server(port, addr=address, registry=self._registry)
        # prometheus_client ≥ 0.17 returns (server, thread); older ones nothing, and their server stays up
        self.server = server if isinstance(server, tuple) else None
        host = f"[{address}]" if ":" in address else address
        self.url = f"http://{host}:{port}/metrics"

    def set(self, figures: Mapping[str, float]) -> None:
        """Set the gauge of each served name in ``figures``."""
        import prometheus_client

        for name, value in figures.items():
            if name not in self._gauges:
                continue
            gauge = self._gauges[name]
            if gauge is None:
                gauge = prometheus_client.Gauge(f"memopt_{name}", f"lightning_memopt {name}", registry=self._registry)
                self._gauges[name] = gauge
            gauge.set(value)

    def close(self) -> None:
        """Shut the server down and free its port."""
        if self.server is not None:
            server, thread = self.server
            server.shutdown()
            server.server_close()
            thread.join(timeout=10)
            self.server = None
