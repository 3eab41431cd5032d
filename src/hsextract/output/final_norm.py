"""The final norm an output stores once (``final_norm.safetensors``): the class that applies it, its file, its check.

No torch at import: finalize and the launcher read the file's metadata without it (tensors are methods' business)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from hsextract.container import header_json, read_head
from hsextract.errors import CorruptOutputError, HsextractError
from hsextract.output.batch import new_checksum, update_checksum

if TYPE_CHECKING:
    import torch

RULES = ("weight", "one_plus_weight")


@dataclass(frozen=True)
class FinalNorm:
    """An RMSNorm as the model applies it after its last decoder layer."""

    weight: torch.Tensor
    """[H], in the dtype the model holds it."""
    eps: float
    rule: str
    """``weight``: ``weight * normed.to(dtype)`` (Llama, Qwen3). ``one_plus_weight``: ``(normed_f32 *
    (1 + weight_f32)).to(dtype)`` (Qwen3.5, Gemma). ``normed`` is ``x_f32 * rsqrt(mean(x_f32^2) + eps)``."""

    RULES: ClassVar[tuple[str, ...]] = RULES

    def __post_init__(self):
        if self.rule not in RULES:
            raise ValueError(f"unknown final-norm rule {self.rule!r}; expected one of {RULES}")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The normed state of ``x`` [..., H], in ``x``'s dtype."""
        dtype = x.dtype
        xf = x.float()
        normed = xf * (xf.pow(2).mean(-1, keepdim=True) + self.eps).rsqrt()
        w = self.weight.to(x.device)
        if self.rule == "one_plus_weight":
            return (normed * (1.0 + w.float())).to(dtype)
        return (w.to(dtype) * normed.to(dtype)).to(dtype)

    def describe(self) -> dict:
        return {"eps": self.eps, "rule": self.rule, "dtype": str(self.weight.dtype).removeprefix("torch.")}

    def write(self, sink) -> None:
        """``final_norm.safetensors`` in the output: the weight as the model holds it, epsilon and rule as
        metadata. The same bytes from every shard, so any shard may write it, any number of times."""
        from safetensors.torch import save

        meta = {"eps": repr(self.eps), **{k: str(v) for k, v in self.describe().items() if k != "eps"}}
        sink.put_bytes(FINAL_NORM, save({"weight": self.weight.contiguous()}, metadata=meta))

    @staticmethod
    def read_meta(sink) -> dict:
        """The final norm's description (key, epsilon, rule, dtype) from ``final_norm.safetensors``, with the
        file's ``size`` and ``xxh3`` that the manifest records (the file is one vector: read whole); read without
        torch; a clear error if no worker wrote it."""
        if not sink.exists(FINAL_NORM):
            raise HsextractError(
                f"{sink.url} has no {FINAL_NORM}, which every worker of a --final-state run writes when it loads "
                "the model: rerun the same command to let a worker write it"
            )
        data = sink.get_bytes(FINAL_NORM)
        return {"key": FINAL_NORM, **describe_final_norm(sink, data), "size": len(data), "xxh3": _xxh3(data)}


def read_final_norm(sink, recorded: dict, *, verify: bool = True) -> FinalNorm:
    """The final norm a ``--final-state`` output holds; ``recorded`` is the manifest's ``final_state.norm``, which
    the file's bytes are checked against when ``verify``."""
    from safetensors.torch import load

    data = read_checked_final_norm(sink, recorded, verify=verify)
    meta = describe_final_norm(sink, data)
    try:
        weight = load(data)["weight"]
    except Exception as e:  # noqa: BLE001 - any unreadable file is a damaged output
        raise CorruptOutputError(
            sink.url, recorded["key"], f"is not a final norm hsextract wrote ({e})"
        ) from None
    return FinalNorm(weight=weight, eps=meta["eps"], rule=meta["rule"])


FINAL_NORM = "final_norm.safetensors"


def describe_final_norm(sink, data: bytes) -> dict:
    """Epsilon, rule and dtype from the header metadata of ``final_norm.safetensors`` as read (``data``)."""

    def damaged(why: str) -> CorruptOutputError:
        return CorruptOutputError(sink.url, FINAL_NORM, f"is not a final norm hsextract wrote ({why})")

    def read(offset: int, length: int) -> bytes:
        if len(data) < offset + length:
            raise damaged(f"it ends at byte {len(data)}, inside its header")
        return data[offset : offset + length]

    meta = header_json(read_head(read, damaged), damaged).get("__metadata__", {})
    try:
        return {"eps": float(meta["eps"]), "rule": meta["rule"], "dtype": meta["dtype"]}
    except (ValueError, KeyError, TypeError) as e:
        raise damaged(f"its metadata lacks {e}") from None


def read_checked_final_norm(sink, recorded: dict, *, verify: bool = True) -> bytes:
    """The bytes of ``final_norm.safetensors``; with ``verify``, ``CorruptOutputError`` unless they are the file
    the manifest recorded in ``recorded`` (its ``final_state.norm``; manifests from before the checksum record
    none, and are not checked). A missing file is a ``CorruptOutputError`` either way."""
    try:
        data = sink.get_bytes(recorded["key"])
    except FileNotFoundError:
        raise CorruptOutputError(
            sink.url, recorded["key"], "does not exist (listed in the manifest)"
        ) from None
    if verify and "xxh3" in recorded:
        got = _xxh3(data)
        if len(data) != recorded["size"] or got != recorded["xxh3"]:
            raise CorruptOutputError(
                sink.url,
                recorded["key"],
                f"is {len(data)} bytes with checksum {got}; the manifest recorded {recorded['size']} bytes with "
                f"checksum {recorded['xxh3']}: it was altered or replaced after the run",
            )
    return data


def _xxh3(data: bytes) -> str:
    checksum = new_checksum()
    update_checksum(checksum, data)
    return checksum.hexdigest()
