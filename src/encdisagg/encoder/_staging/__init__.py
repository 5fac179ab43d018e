"""Staged memory and who owns it: the region owner (``_regions``) stages embeddings into the
arena (``_arena``) or their own tensors, holds every engine registration and deregisters
them; ``_held`` keeps the frees a transfer's hold defers, ``_budget`` counts the staged
bytes, and ``_staged`` is what they hand around. None of them imports the rest of the
Encoder.
"""
