"""The encoder server: Quart on Hypercorn, on asyncio or Trio.

- :func:`create_app` / :func:`create_trio_app`: an app serving DESIGN §4.7's routes, with the
  Encoder (or data-parallel workers) opened in its lifespan.
- :func:`mount_encoder`: the same routes and lifespan on an existing Quart app.
- :class:`ServerSettings`: data parallelism, body limit, health probe bound.
- :func:`serve`: run an app with Hypercorn on the current event loop.
- :class:`EncoderMetrics` / :class:`ServerMetrics`: Prometheus metrics, per app.
- :class:`LocalBackend` / :class:`DataParallelBackend`: what the routes call.
"""

from ._app import (
    EncoderService as EncoderService,
    create_app as create_app,
    create_trio_app as create_trio_app,
    mount_encoder as mount_encoder,
)
from ._backend import (
    Backend as Backend,
    HealthReport as HealthReport,
    LocalBackend as LocalBackend,
)
from ._dp import DataParallelBackend as DataParallelBackend
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
from ._runner import bind_socket as bind_socket, serve as serve
from ._settings import ServerSettings as ServerSettings

__all__ = (
    "create_app",
    "create_trio_app",
    "mount_encoder",
    "serve",
    "bind_socket",
    "ServerSettings",
    "EncoderService",
    "Backend",
    "LocalBackend",
    "DataParallelBackend",
    "HealthReport",
    "EncoderMetrics",
    "ServerMetrics",
    "MetricsSnapshot",
    "ServiceSnapshot",
    "WorkerStatus",
    "EncodeBody",
    "SendBody",
    "ReceiveUrlBody",
    "MetadataBody",
    "ReleaseBody",
)

for _name in __all__:
    _value = globals()[_name]
    if isinstance(_value, type) or callable(_value):
        _value.__module__ = __name__
del _name, _value
