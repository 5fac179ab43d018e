"""The seeded, randomly initialised tiny models: real architectures and processors, tiny
widths."""
