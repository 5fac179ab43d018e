"""The ASGI layer around the app: Hypercorn serving, the lifespan, and the middleware.

``_runner`` serves an app on the running event loop over a socket bound first
(``_listen``); ``_lifespan`` runs the app's lifespan inside the encoder service;
``_request_log`` writes one access line per request; ``_read_turns`` and ``_eof_close`` work
around Hypercorn's reading and keep-alive behaviour. None of them imports the app or the
service.
"""
