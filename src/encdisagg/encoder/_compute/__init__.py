"""The compute path, from a request's items to its embedding rows: ``_path`` runs it (cache
tiers, preprocessing, the forward, validation), over the media budgets of ``_inputs``, the
single-flight of ``_flights``, the queued-input budget of ``_queued``, the batcher, the local
prefix cache and the span names of ``_traced``.
"""
