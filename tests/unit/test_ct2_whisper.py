"""worker/mlx_engine/ct2_whisper.py's model.bin reader on a hand-made file: CTranslate2's layout (binary version 6),
an int8 weight dequantized by its per-row scale, an alias resolved, and a truncated or foreign file refused."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from worker.mlx_engine.ct2_whisper import CT2Error, dense, read_model_bin


def text(s: str) -> bytes:
    raw = s.encode() + b"\0"
    return struct.pack("<H", len(raw)) + raw


def variable(name: str, value: np.ndarray, dtype_id: int) -> bytes:
    raw = value.tobytes()
    return (text(name) + struct.pack("<B", value.ndim) + struct.pack(f"<{value.ndim}I", *value.shape)
            + struct.pack("<BI", dtype_id, len(raw)) + raw)


def model_bin(spec: str = "WhisperSpec") -> bytes:
    weight = np.array([[127, -64], [10, 20]], np.int8)
    scale = np.array([127.0, 10.0], np.float32)
    table = np.arange(6, dtype=np.float16).reshape(3, 2)
    return (struct.pack("<I", 6) + text(spec) + struct.pack("<II", 3, 3)
            + variable("a/linear_0/weight", weight, 1) + variable("a/linear_0/weight_scale", scale, 0)
            + variable("decoder/embeddings/weight", table, 4)
            + struct.pack("<I", 1) + text("decoder/projection/weight") + text("decoder/embeddings/weight"))


def test_variables_are_read_int8_dequantized_and_aliases_resolved() -> None:
    v = read_model_bin(model_bin())
    assert np.array_equal(dense(v, "a/linear_0/weight"), np.array([[1.0, -64 / 127], [1.0, 2.0]], np.float32))
    assert v["decoder/embeddings/weight"].dtype == np.float16
    assert np.array_equal(v["decoder/projection/weight"], np.arange(6).reshape(3, 2))


@pytest.mark.parametrize("data, says", [
    (model_bin()[:-30], "truncated"),
    (model_bin("TransformerSpec"), "not a WhisperSpec"),
    (struct.pack("<I", 5) + model_bin()[4:], "version 5"),
])
def test_a_file_it_cannot_read_is_refused_naming_why(data: bytes, says: str) -> None:
    with pytest.raises(CT2Error, match=says):
        read_model_bin(data)
