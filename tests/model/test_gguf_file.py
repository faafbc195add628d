"""model/gguf_file.py reads what the `gguf` package's own reader reads: every metadata value of
every type (long arrays counted), and each tensor's name, type, shape and bytes."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from pagedllm.model.gguf_file import LONGEST_ARRAY_READ, read_gguf
from pagedllm.model.locate import default_model_path

SCALARS = {
    "t.u8": (7, gguf.GGUFValueType.UINT8),
    "t.i8": (-7, gguf.GGUFValueType.INT8),
    "t.u16": (65535, gguf.GGUFValueType.UINT16),
    "t.i16": (-300, gguf.GGUFValueType.INT16),
    "t.u32": (4_000_000_000, gguf.GGUFValueType.UINT32),
    "t.i32": (-5, gguf.GGUFValueType.INT32),
    "t.f32": (0.1, gguf.GGUFValueType.FLOAT32),
    "t.bool": (True, gguf.GGUFValueType.BOOL),
    "t.str": ("héllo wörld", gguf.GGUFValueType.STRING),
    "t.u64": (2**63 + 5, gguf.GGUFValueType.UINT64),
    "t.i64": (-(2**40), gguf.GGUFValueType.INT64),
    "t.f64": (1e-300, gguf.GGUFValueType.FLOAT64),
}


def test_metadata_and_tensors_are_what_the_gguf_package_reads(tmp_path):
    path = tmp_path / "all-types.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, (value, kind) in SCALARS.items():
        writer.add_key_value(key, value, kind)
    writer.add_array("t.short_ints", [1, -2, 3])
    writer.add_array("t.short_floats", [0.5, -1.25])
    writer.add_array("t.short_bools", [True, False, True])
    writer.add_array("t.short_strings", ["a", "", "ünï"])
    writer.add_array("t.long_strings", [f"token{i}" for i in range(LONGEST_ARRAY_READ + 1)])
    writer.add_key_value(
        "t.nested", [[1, 2], [3]], gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.ARRAY
    )
    rng = np.random.default_rng(0)
    floats = rng.standard_normal((3, 64)).astype(np.float32)
    writer.add_tensor("a.weight", floats)
    writer.add_tensor("b.weight", floats.astype(np.float16))
    q8 = gguf.quantize(rng.standard_normal((4, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("c.weight", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    for write in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file):
        write()
    writer.close()

    ours, theirs = read_gguf(path), gguf.GGUFReader(str(path))
    fields = {key: field for key, field in theirs.fields.items() if not key.startswith("GGUF.")}
    for key, field in fields.items():  # (GGUF.*: the reader's own names for the header)
        is_array = field.types[0] == gguf.GGUFValueType.ARRAY
        if is_array and field.types[1] == gguf.GGUFValueType.ARRAY:  # the reader flattens its items
            assert ours.array_lengths[key] == 2 and key not in ours.metadata
            continue
        if is_array:
            assert ours.array_lengths[key] == len(field.data), key
        if is_array and len(field.data) > LONGEST_ARRAY_READ:
            assert key not in ours.metadata, key
        else:
            assert ours.metadata[key] == pytest.approx(field.contents()), key
    assert set(ours.metadata) | set(ours.array_lengths) == set(fields)
    assert [(t.name, t.tensor_type, t.shape) for t in ours.tensors] == [
        (t.name, t.tensor_type, tuple(int(d) for d in t.shape)) for t in theirs.tensors
    ]
    for mine, reference in zip(ours.tensors, theirs.tensors, strict=True):
        assert mine.data.tobytes() == reference.data.tobytes(), mine.name


@pytest.mark.slow  # the gguf package's reader takes seconds; every engine test reads this file
def test_the_default_model_reads_as_the_gguf_package_reads_it():
    """A real file: its scalars and short arrays equal, the vocabulary and merges only counted."""
    ours, theirs = read_gguf(default_model_path()), gguf.GGUFReader(str(default_model_path()))
    assert ours.array_lengths["tokenizer.ggml.tokens"] == len(theirs.fields["tokenizer.ggml.tokens"].data)
    assert "tokenizer.ggml.tokens" not in ours.metadata
    for key, value in ours.metadata.items():
        assert value == pytest.approx(theirs.fields[key].contents()), key
    assert len(ours.tensors) == len(theirs.tensors)
