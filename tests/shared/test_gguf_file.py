"""shared.gguf_file reads what the gguf package's GGUFReader reads (the values, the tensor table
and the tensors' bytes), on the shipped model and on files that package writes with every value
type; broken files are a GgufFormatError naming the file."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

from shared.gguf_file import GgufFile, GgufFormatError
from shared.model_source import resolve_model


def same_as_gguf_reader(path, nested=()):
    """nested: keys of arrays of arrays, which GGUFReader's contents() flattens (we keep them)."""
    ours, ref = GgufFile(path), GGUFReader(path)
    want = {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert {k: v for k, v in ours.fields.items() if k not in nested} == \
        {k: v for k, v in want.items() if k not in nested}
    for k in nested:
        assert [x for part in ours.fields[k] for x in part] == want[k]
    assert ours.data_offset == ref.data_offset and len(ours.tensors) == len(ref.tensors)
    for a, b in zip(ours.tensors, ref.tensors):
        assert (a.name, a.tensor_type, a.shape, a.n_bytes, a.data_offset) == \
            (b.name, b.tensor_type, tuple(int(d) for d in b.shape), b.n_bytes, b.data_offset)
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape
        assert np.array_equal(a.data, b.data, equal_nan=True)
    return ours


def test_the_shipped_model_reads_as_gguf_reader_reads_it():
    f = same_as_gguf_reader(resolve_model(None).path)
    assert len(f.fields["tokenizer.ggml.tokens"]) == 49152 and f.fields["general.architecture"] == "llama"


@pytest.mark.parametrize("alignment", [None, 64])
def test_every_value_type_and_tensor_kind_written_by_gguf_reads_back_the_same(tmp_path, alignment):
    path = tmp_path / "m.gguf"
    w = GGUFWriter(str(path), "llama")
    if alignment:
        w.add_custom_alignment(alignment)
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -5)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 1.5)
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**62))
    w.add_float64("t.f64", 2.25)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo")
    w.add_array("t.strs", ["a", "", "ü" * 3, "<|im_start|>"])
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, 1.25])
    w.add_key_value("t.nested", [[1, 2], [3]], GGUFValueType.ARRAY)
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((4, 8)).astype(np.float16))
    q8 = rng.integers(0, 255, (2, 34 * 2), dtype=np.uint8)           # 2 rows of 2 Q8_0 blocks
    w.add_tensor("q8", q8, raw_dtype=GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    f = same_as_gguf_reader(path, nested=("t.nested",))
    assert f.fields["t.nested"] == [[1, 2], [3]]
    assert f.fields["t.strs"] == ["a", "", "üüü", "<|im_start|>"] and f.fields["t.u64"] == 2**63 + 5
    assert f.alignment == (alignment or 32) and f.data_offset % f.alignment == 0
    assert f.tensors[2].data.shape == (2, 68) and np.array_equal(f.tensors[2].data, q8)


def test_broken_files_are_format_errors_naming_the_file(tmp_path):
    good = resolve_model(None).path.read_bytes()[:4_000_000]
    cases = {"not.gguf": b"PK\x03\x04 a zip file" + b"\0" * 64,
             "cut_in_metadata.gguf": good[:100_000],                   # inside the vocabulary
             "cut_in_tensors.gguf": good,                             # metadata whole, weights missing
             "big_endian.gguf": b"GGUF" + (3).to_bytes(4, "big") + b"\0" * 64}
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(GgufFormatError, match=name):
            GgufFile(tmp_path / name)
