"""Data parallel: one front in the server's process, one Encoder in each worker process.

The front (:class:`._front.DataParallelBackend`) answers the routes as a local backend does;
it places each call on a worker (``_dispatch``), matches replies to the calls awaiting them
(``_calls``), and supervises and restarts the worker processes (``_workers``,
``_restarts``); ``_process_metrics`` reads their CPU and memory from ``/proc``. Front and
workers speak msgpack over ZMQ IPC (``_ipc``); the worker process's own entry point is
``server._serve._worker``.
"""
