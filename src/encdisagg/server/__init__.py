"""The encoder server: Quart on Hypercorn, on asyncio or Trio.

- :func:`create_app` / :func:`create_trio_app`: an app serving DESIGN §4.7's routes, with the
  Encoder (or data-parallel workers) opened in its lifespan.
- :func:`mount_encoder`: the same routes and lifespan on an existing Quart app.
- :class:`ServerSettings`: data parallelism, body limit, health probe bound.
- :func:`serve`: run an app with Hypercorn on the current event loop.
- :class:`EncoderMetrics` / :class:`ServerMetrics`: Prometheus metrics, per app.
- :class:`LocalBackend` / :class:`DataParallelBackend`: what the routes call.
- :func:`configure_logging`: the log handler ``encdisagg serve`` installs (text or JSON lines,
  each record with the served request's ``req_id``), for apps that embed the routes.

The names load on first use: ``encdisagg serve`` checks its options (``ServerSettings``
included) before torch and the model code are imported, so a bad value answers at once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._exports import lazy_exports

if TYPE_CHECKING:
    from ._app import (
        create_app as create_app,
        create_trio_app as create_trio_app,
        mount_encoder as mount_encoder,
    )
    from ._asgi._listen import bind_socket as bind_socket
    from ._asgi._runner import serve as serve
    from ._backend import (
        Backend as Backend,
        HealthReport as HealthReport,
        LocalBackend as LocalBackend,
    )
    from ._dp._front import DataParallelBackend as DataParallelBackend
    from ._logs import configure_logging as configure_logging
    from ._messages import (
        EncodeBody as EncodeBody,
        MetadataBody as MetadataBody,
        ReceiveUrlBody as ReceiveUrlBody,
        ReleaseBody as ReleaseBody,
        SendBody as SendBody,
    )
    from ._metrics import (
        EncoderMetrics as EncoderMetrics,
        MetricsSnapshot as MetricsSnapshot,
        ServerMetrics as ServerMetrics,
        ServiceSnapshot as ServiceSnapshot,
        WorkerStatus as WorkerStatus,
    )
    from ._service import EncoderService as EncoderService
    from ._settings import ServerSettings as ServerSettings

#: Each public name -> the private module that defines it.
_LAZY = {
    "create_app": "._app",
    "create_trio_app": "._app",
    "mount_encoder": "._app",
    "EncoderService": "._service",
    "serve": "._asgi._runner",
    "bind_socket": "._asgi._listen",
    "configure_logging": "._logs",
    "ServerSettings": "._settings",
    "Backend": "._backend",
    "LocalBackend": "._backend",
    "HealthReport": "._backend",
    "DataParallelBackend": "._dp._front",
    "EncoderMetrics": "._metrics",
    "ServerMetrics": "._metrics",
    "MetricsSnapshot": "._metrics",
    "ServiceSnapshot": "._metrics",
    "WorkerStatus": "._metrics",
    "EncodeBody": "._messages",
    "SendBody": "._messages",
    "ReceiveUrlBody": "._messages",
    "MetadataBody": "._messages",
    "ReleaseBody": "._messages",
}

__all__ = tuple(_LAZY)

__getattr__, __dir__ = lazy_exports(globals(), _LAZY, claim=True)
