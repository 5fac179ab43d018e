"""Embedding push and pull over ZMQ, native to AnyIO: the push pool (``_push``) and what it
waits on (``_socket``: a socket's state and its monitor; ``_release``: ZMQ letting go of a
zero-copy frame), the PULL receiver (``_pull``), and CURVE keys for both ends (``_curve``)."""
