"""hsextract: hidden states of chosen decoder layers, for training speculative-decoding drafters."""

__version__ = "0.1.0"
