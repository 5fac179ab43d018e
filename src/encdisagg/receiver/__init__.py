"""The prefill side of encoder disaggregation: getting a request's embeddings.

- :class:`EncoderClient`: splits a request's media into parts across encoder servers
  (:func:`assign_parts`) and drives their HTTP API (``/encode``, ``/send``, ``/release``);
  failures name the encoder (:class:`EncoderCallError`); a release says which parts may
  still be written into (:class:`ReleaseOutcome`).
- :class:`EmbeddingReceiver`: where the parts land, over ZMQ or into a registered Mooncake
  :class:`LandingPool`; validates and assembles them (:class:`ReceivedEmbeddings`).
- :func:`fetch_embeddings`: both together, for one request, with cleanup on every path.
- :class:`EncoderFleet`: encoders discovered through an etcd registry, each item routed to
  the encoder likely to hold its embedding under a load bound, or by load alone
  (:class:`FleetRouting`, :func:`affinity_key`); :func:`fetch_from_fleet` fails parts over
  between them.
"""

from .._exports import claim_exports
from ._call_errors import EncoderLeftError as EncoderLeftError
from ._client import (
    EncoderCallError as EncoderCallError,
    EncoderClient as EncoderClient,
    ReleaseOutcome as ReleaseOutcome,
)
from ._encoder_wire import (
    MooncakeSendTarget as MooncakeSendTarget,
    PartMetadata as PartMetadata,
    SendTarget as SendTarget,
    ZmqSendTarget as ZmqSendTarget,
)
from ._fetch import fetch_embeddings as fetch_embeddings, fetch_from_fleet as fetch_from_fleet
from ._fleet import EncoderFleet as EncoderFleet
from ._landing import LandingPool as LandingPool, PageRun as PageRun
from ._landing_holds import Recheck as Recheck
from ._pending import PendingEmbeddings as PendingEmbeddings
from ._plan import (
    PartPlan as PartPlan,
    RequestPlan as RequestPlan,
    assign_parts as assign_parts,
    part_req_id as part_req_id,
)
from ._received import (
    EmbeddingPart as EmbeddingPart,
    ModalityEmbeddings as ModalityEmbeddings,
    ReceivedEmbeddings as ReceivedEmbeddings,
    ReceiverStats as ReceiverStats,
)
from ._receiver import EmbeddingReceiver as EmbeddingReceiver
from ._routing import FleetRouting as FleetRouting, affinity_key as affinity_key

__all__ = (
    "EncoderClient",
    "EncoderCallError",
    "ReleaseOutcome",
    "SendTarget",
    "ZmqSendTarget",
    "MooncakeSendTarget",
    "PartMetadata",
    "PartPlan",
    "RequestPlan",
    "assign_parts",
    "part_req_id",
    "EmbeddingReceiver",
    "PendingEmbeddings",
    "ReceivedEmbeddings",
    "EmbeddingPart",
    "ModalityEmbeddings",
    "ReceiverStats",
    "LandingPool",
    "PageRun",
    "Recheck",
    "fetch_embeddings",
    "EncoderFleet",
    "FleetRouting",
    "affinity_key",
    "EncoderLeftError",
    "fetch_from_fleet",
)

claim_exports(globals())
