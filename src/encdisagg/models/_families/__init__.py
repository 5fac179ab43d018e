"""The model adapters: each family's tower or encoder behind ``VisionModel``, with its
processor, and what the adapters share."""
