"""The embedding cache's global tier: encoders share embeddings through a Mooncake Store.

- :func:`parse_global_cache_url` / :class:`GlobalCacheSettings`: the ``global_cache`` URL.
- :class:`GlobalCache`: the tier itself (lookups with a bounded wait, background inserts,
  evictions of invalid entries, a circuit breaker); :class:`GlobalCacheStats` its counters.
- :class:`KeySpace` / :class:`ModalityKeys`: content-addressed keys, one per item, that name
  the model. :class:`ItemPlan`: the per-item decisions of one encode.
- :class:`CircuitBreaker`: the synchronous breaker, clock injected.
- The stored format (:func:`entry_header`, :func:`read_entry`) and the store protocol
  (:class:`EmbeddingStore`, :func:`open_mooncake_store`).

The local tier is the Encoder's :class:`~encdisagg.encoder.PrefixCache`; see ``docs/cache.md``.
"""

from .._exports import claim_exports
from ._breaker import BreakerState as BreakerState, CircuitBreaker as CircuitBreaker
from ._entry import (
    CachedItem as CachedItem,
    InvalidEntryError as InvalidEntryError,
    entry_header as entry_header,
    read_entry as read_entry,
)
from ._global import GlobalCache as GlobalCache
from ._item_plan import ItemPlan as ItemPlan, Origin as Origin, relabel_items as relabel_items
from ._keys import (
    KeySpace as KeySpace,
    ModalityKeys as ModalityKeys,
    content_digest as content_digest,
)
from ._stats import GlobalCacheStats as GlobalCacheStats
from ._store import (
    EmbeddingStore as EmbeddingStore,
    MooncakeEmbeddingStore as MooncakeEmbeddingStore,
    ensure_mooncake_store as ensure_mooncake_store,
    open_mooncake_store as open_mooncake_store,
    rc_name as rc_name,
)
from ._store_url import (
    GlobalCacheSettings as GlobalCacheSettings,
    parse_global_cache_url as parse_global_cache_url,
)

__all__ = (
    "parse_global_cache_url",
    "GlobalCacheSettings",
    "GlobalCache",
    "GlobalCacheStats",
    "KeySpace",
    "ModalityKeys",
    "content_digest",
    "ItemPlan",
    "Origin",
    "relabel_items",
    "CachedItem",
    "InvalidEntryError",
    "entry_header",
    "read_entry",
    "CircuitBreaker",
    "BreakerState",
    "EmbeddingStore",
    "MooncakeEmbeddingStore",
    "ensure_mooncake_store",
    "open_mooncake_store",
    "rc_name",
)

claim_exports(globals())
