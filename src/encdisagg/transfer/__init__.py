"""Transfer engines and the embedding wire format.

- :class:`TransferEngine`: the protocol the Encoder moves registered memory with;
  :class:`LoopbackEngine` (in-process) and :class:`MooncakeEngine` implement it.
- Memory a transfer may still touch (the transfer contract, ``docs/cancellation.md``):
  :class:`Hold`, settled only by proof that the transfer stopped; :class:`HeldLedger`, an
  owner's count of them; :class:`HoldPolicy`, what a side does when its bound runs out;
  :class:`MemoryRegistration`, one buffer registered once and deregistered once, never while held;
  :func:`leave_with_engine`, memory kept as long as its engine may touch it.
- The embedding push format (DESIGN §5.2): :class:`EmbeddingHeader`, :func:`encode_header`,
  :func:`decode_header` and the payload helpers; :class:`EmbeddingLayout` names the column
  sections of a joint embedding (Qwen3-VL's deepstack features beside the main one).
- ZMQ push and pull that work on asyncio and Trio: :class:`ZmqPushPool`, :class:`ZmqReceiver`.
"""

from .._exports import claim_exports
from ._engine import EngineOptions as EngineOptions, TransferEngine as TransferEngine
from ._holds import HeldLedger as HeldLedger, Hold as Hold, HoldPolicy as HoldPolicy
from ._layout import (
    MAIN_SECTION as MAIN_SECTION,
    EmbeddingLayout as EmbeddingLayout,
    deepstack_layout as deepstack_layout,
)
from ._lifetime import KeepsMemory as KeepsMemory, leave_with_engine as leave_with_engine
from ._loopback import LoopbackEngine as LoopbackEngine, LoopbackFabric as LoopbackFabric
from ._memory_registration import (
    MemoryRegistration as MemoryRegistration,
    MemoryRegistrationState as MemoryRegistrationState,
)
from ._mooncake._engine import MooncakeEngine as MooncakeEngine
from ._wire import (
    MAX_HEADER_BYTES as MAX_HEADER_BYTES,
    WIRE_VERSION as WIRE_VERSION,
    EmbeddingHeader as EmbeddingHeader,
    decode_header as decode_header,
    dtype_name as dtype_name,
    encode_header as encode_header,
    payload_nbytes as payload_nbytes,
    payload_view as payload_view,
    tensor_from_frame as tensor_from_frame,
    torch_dtype as torch_dtype,
)
from ._zmq._pull import ReceivedPart as ReceivedPart, ZmqReceiver as ZmqReceiver
from ._zmq._push import ZmqPushPool as ZmqPushPool

__all__ = (
    "EngineOptions",
    "TransferEngine",
    "Hold",
    "HeldLedger",
    "HoldPolicy",
    "KeepsMemory",
    "MemoryRegistration",
    "MemoryRegistrationState",
    "leave_with_engine",
    "LoopbackEngine",
    "LoopbackFabric",
    "MooncakeEngine",
    "WIRE_VERSION",
    "MAX_HEADER_BYTES",
    "EmbeddingHeader",
    "encode_header",
    "decode_header",
    "payload_nbytes",
    "payload_view",
    "tensor_from_frame",
    "dtype_name",
    "torch_dtype",
    "ReceivedPart",
    "ZmqPushPool",
    "ZmqReceiver",
    "EmbeddingLayout",
    "MAIN_SECTION",
    "deepstack_layout",
)

claim_exports(globals())
