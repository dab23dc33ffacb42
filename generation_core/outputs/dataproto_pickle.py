"""A verl DataProto written as a pickle without the copies verl's `DataProto.__getstate__` makes:
`dump_dataproto` streams the tensors to the file and hashes what it writes (the merge's output
files, outputs/merge.py)."""

from __future__ import annotations

import copyreg
import hashlib
import io
import pickle

import torch
from verl.protocol import DataProto

from generation_core.verl_adapter import dataproto_state


class _Sink:
    """A write-only file for torch.save that passes bytes on (or only counts them) and hashes them."""

    def __init__(self, target=None):
        self.target, self.size, self.digest = target, 0, hashlib.sha256()

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self.size += len(view)
        self.digest.update(view)
        if self.target is not None:
            self.target.write(view)
        return len(view)

    def flush(self) -> None:
        pass


# Stands for the tensor blob while pickling the rest: larger than pickle's frame target (64 KiB),
# so the pickler writes it outside any frame, as opcode + length + payload, which can be replaced.
_BLOB_PLACEHOLDER = hashlib.sha256(b"genrun tensor blob").digest() * 4096
# Pickle's BINBYTES takes a 4-byte length; larger blobs need BINBYTES8 (protocol 4+).
_BINBYTES_LIMIT = 1 << 32


def dump_dataproto(data: DataProto, handle) -> tuple[int, str]:
    """Write what `pickle.dump(data, handle, protocol=5)` writes in substance, streaming the
    tensors to `handle` instead of through the copies verl's `DataProto.__getstate__` makes
    (contiguous, consolidate, a BytesIO and its getvalue). The file is a plain pickle of a
    DataProto whose state is (torch.save bytes of the TensorDict, non_tensor_batch, meta_info),
    the state verl's `__setstate__` reads: `pickle.load` and `DataProto.load_from_disk` load it
    wherever verl is installed. Returns the file's (size, sha256)."""

    class _StatePickler(pickle.Pickler):
        def reducer_override(self, obj):
            if obj is data:
                new_object = copyreg.__newobj__  # type: ignore[attr-defined]  # typeshed omits copyreg.__newobj__
                return (
                    new_object,
                    (DataProto,),
                    dataproto_state(_BLOB_PLACEHOLDER, data.non_tensor_batch, data.meta_info),
                )
            return NotImplemented

    buffer = io.BytesIO()
    _StatePickler(buffer, protocol=5).dump(data)
    rest = buffer.getvalue()
    at = rest.index(_BLOB_PLACEHOLDER)
    if rest[at - 5 : at] != b"B" + len(_BLOB_PLACEHOLDER).to_bytes(4, "little"):
        raise AssertionError("unexpected pickle layout around the tensor blob")
    # torch.save twice: once to learn the blob's length (the opcode comes before the payload), once to write it.
    counted = _Sink()
    torch.save(data.batch, counted)  # type: ignore[arg-type]  # torch types a file as IO[bytes]; it calls only write and flush
    out = _Sink(handle)
    out.write(rest[: at - 5])
    out.write(
        b"B" + counted.size.to_bytes(4, "little")
        if counted.size < _BINBYTES_LIMIT
        else b"\x8e" + counted.size.to_bytes(8, "little")
    )
    blob_start = out.size
    torch.save(data.batch, out)  # type: ignore[arg-type]  # as above
    if out.size - blob_start != counted.size:
        raise AssertionError("torch.save wrote a different blob the second time")
    out.write(rest[at + len(_BLOB_PLACEHOLDER) :])
    return out.size, out.digest.hexdigest()
