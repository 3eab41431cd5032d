"""hsextract: hidden states of chosen decoder layers, for training speculative-decoding drafters."""

__version__ = "0.1.0"

from hsextract.errors import install_redaction  # noqa: E402  (every process imports the package: see there)

install_redaction()
