"""SGLang's wire (``--wire sglang``): SGLang's encoder routes, bodies and push, and its gRPC
``SglangEncoder`` service beside HTTP (``--grpc-port``).

Both transports call one transport-neutral :class:`._service.SglangService` over the running
backend. The gRPC server runs on an asyncio loop of its own (``_grpc_server``), turns RPCs
into SGLang's bodies (``_grpc_service``), and is opened inside the encoder service's
lifespan (``_grpc_beside``).
"""
