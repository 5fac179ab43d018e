"""encdisagg: encoder disaggregation for multimodal LLM serving.

Vision and audio encoders run as their own service and ship embeddings to the LLM's prefill
instances. Every encode, send and transfer runs inside a task group that owns the memory it
touches, so memory is never released while a transfer still reads it.
"""

from ._config import EncoderConfig as EncoderConfig
from ._errors import (
    BadRequestError as BadRequestError,
    EncdisaggError as EncdisaggError,
    InternalError as InternalError,
    NotFoundError as NotFoundError,
    RequestNotActiveError as RequestNotActiveError,
    RequestTimeoutError as RequestTimeoutError,
    ServiceUnavailableError as ServiceUnavailableError,
    TransferError as TransferError,
)
from ._version import __version__ as __version__

__all__ = (
    "__version__",
    "EncoderConfig",
    "EncdisaggError",
    "BadRequestError",
    "NotFoundError",
    "RequestNotActiveError",
    "RequestTimeoutError",
    "TransferError",
    "ServiceUnavailableError",
    "InternalError",
)

for _name in __all__[1:]:
    globals()[_name].__module__ = __name__
del _name
