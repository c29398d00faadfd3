"""KV blocks on Ray's object store: tensors as numpy arrays, so a reader on the same node maps them zero-copy.

Ray stores numpy arrays in its shared-memory object store and ``ray.get`` on the same node returns a
read-only view of that memory (no copy, no unpickling of the payload); a torch tensor would be pickled and
copied. bfloat16 has no numpy dtype, so its bits travel as int16 and are viewed back on arrival.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

_BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16}


def to_wire(blocks: torch.Tensor) -> tuple[np.ndarray, str]:
    """A CPU numpy array holding ``blocks``' bytes, and the torch dtype's name to view them back."""
    t = blocks.detach().to("cpu").contiguous()
    dtype = str(t.dtype).removeprefix("torch.")
    if t.dtype in _BITS:
        t = t.view(_BITS[t.dtype])
    return t.numpy(), dtype


def from_wire(array: np.ndarray, dtype: str) -> torch.Tensor:
    """The tensor ``to_wire`` sent, over the array's memory (read-only views stay unwritten: we only read)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch warns that the shared view is not writable
        t = torch.from_numpy(array)
    want = getattr(torch, dtype)
    return t.view(want) if want in _BITS else t
