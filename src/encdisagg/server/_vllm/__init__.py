"""``--wire vllm``: this server as the encoder instance of vLLM's disaggregated encoder.

vLLM's proxy posts each request's media items to ``/v1/chat/completions``; the server
encodes them, hands the embeddings to the PD the way its EC connector reads them (a file
beneath a shared folder, or a Mooncake push into the PD's reserved buffers) and answers the
placeholder metadata the proxy forwards. See docs/vllm.md.

Nothing is imported here: the wire loads torch; the ``vllm_*`` settings are checked in
``server._settings`` before it does.
"""
