"""The encoder fleet's registry: encoders announce themselves in etcd, clients watch.

- :func:`parse_registry_url`: ``etcd://HOST:PORT/PREFIX`` (:class:`RegistryUrl`).
- :class:`EncoderRecord`: what one encoder publishes (URL, model, modalities, transfer
  kinds, capacity, and an :class:`EncoderLoad` refreshed every few seconds).
- :class:`Registration`: keeps one record under the prefix, bound to a lease it renews;
  :meth:`Registration.withdraw` removes it first when the encoder drains.
- :class:`RegistryWatcher`: one watch on the prefix keeps a :class:`RegistryView` current.
- :class:`EtcdClient`: the small etcd v3 client (JSON gateway over ``httpx``) under both.

See ``docs/scaling.md`` for the topology and the timings.
"""

from .._exports import claim_exports
from ._etcd import (
    EtcdClient as EtcdClient,
    KeyValue as KeyValue,
    RegistryUnavailableError as RegistryUnavailableError,
    WatchEvent as WatchEvent,
)
from ._record import EncoderLoad as EncoderLoad, EncoderRecord as EncoderRecord
from ._registration import Registration as Registration
from ._url import RegistryUrl as RegistryUrl, parse_registry_url as parse_registry_url
from ._watch import RegistryView as RegistryView, RegistryWatcher as RegistryWatcher

__all__ = (
    "parse_registry_url",
    "RegistryUrl",
    "EncoderRecord",
    "EncoderLoad",
    "Registration",
    "RegistryWatcher",
    "RegistryView",
    "EtcdClient",
    "KeyValue",
    "WatchEvent",
    "RegistryUnavailableError",
)

claim_exports(globals())
