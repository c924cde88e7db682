"""Megatron-LM indexed datasets (PREFIX.bin + PREFIX.idx) written by the tests themselves, from
the format Megatron-LM documents (megatron/core/datasets/indexed_dataset.py, ``_IndexWriter``),
never with the code under test: the 9-byte magic ``MMIDIDX\\x00\\x00``, version 1 (uint64), the
dtype code (uint8), the sequence and document-entry counts (uint64 each), int32 sizes, int64
byte pointers, int64 document indices (the first sequence of each document, then the count)."""

import struct

import numpy as np

CODES = {np.uint8: 1, np.int8: 2, np.int16: 3, np.int32: 4, np.int64: 5, np.uint16: 8}


def write_megatron(prefix, documents, dtype=np.uint16, code=None, pointers=None, magic=b"MMIDIDX\x00\x00",
                   version=1):
    """``documents``: a list of documents, each a list of sequences (lists of ids)."""
    sequences = [np.asarray(s, dtype=dtype) for doc in documents for s in doc]
    sizes = np.array([len(s) for s in sequences], dtype="<i4")
    item = np.dtype(dtype).itemsize
    if pointers is None:
        pointers = np.concatenate([[0], np.cumsum(sizes[:-1].astype(np.int64) * item)]).astype("<i8")
    doc_index = np.concatenate([[0], np.cumsum([len(d) for d in documents])]).astype("<i8")
    with open(f"{prefix}.idx", "wb") as f:
        f.write(magic + struct.pack("<QBQQ", version, code or CODES[dtype], len(sizes), len(doc_index)))
        f.write(sizes.tobytes() + np.asarray(pointers, dtype="<i8").tobytes() + doc_index.tobytes())
    with open(f"{prefix}.bin", "wb") as f:
        for s in sequences:
            f.write(s.astype(np.dtype(dtype).newbyteorder("<")).tobytes())
