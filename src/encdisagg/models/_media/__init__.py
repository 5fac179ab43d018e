"""Media items into pixels, frames and waveforms: where items may come from, what they may
cost, and their decoding."""
