"""hsextract: hidden states of chosen decoder layers, for training speculative-decoding drafters."""

__version__ = "0.1.0"


def lazy_exports(package: str, exports: dict[str, str], home: str | None = None):
    """``__getattr__`` and ``__dir__`` for ``package`` whose public names (each -> the module of the package that
    defines it, or of ``home`` for a face module beside its package's modules) load their module on first use
    (PEP 562): importing the package imports none of them."""
    import importlib
    import sys

    def __getattr__(name: str):
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{home or package}.{exports[name]}"), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(exports)

    return __getattr__, __dir__
