"""worker/mlx_engine/onnx_kokoro.py's pieces on hand-made input: the protobuf reader on a two-node ONNX graph written
here, node scopes mapped to Kokoro's checkpoint modules, dequantization with a shared zero point, LSTM gate order."""

from __future__ import annotations

import numpy as np
import pytest

from worker.mlx_engine.onnx_kokoro import Dequantizer, KokoroImportError, _gates, module_of, read_onnx


def varint(x: int) -> bytes:
    out = b""
    while True:
        out += bytes([(x & 0x7F) | (0x80 if x > 0x7F else 0)])
        x >>= 7
        if not x:
            return out


def field(number: int, payload: bytes | int) -> bytes:
    if isinstance(payload, int):
        return varint(number << 3) + varint(payload)
    return varint(number << 3 | 2) + varint(len(payload)) + payload


def tensor(name: str, array: np.ndarray, dtype: int) -> bytes:
    dims = b"".join(varint(d) for d in array.shape)
    return field(1, dims) + field(2, dtype) + field(8, name.encode()) + field(9, array.tobytes())


def node(name: str, op: str, inputs: list[str]) -> bytes:
    return b"".join(field(1, i.encode()) for i in inputs) + field(3, name.encode()) + field(4, op.encode())


def test_initializers_and_nodes_are_read() -> None:
    w = np.array([[1, -2, 3], [4, 5, -6]], np.int8)
    graph = (field(1, node("/encoder/bert_encoder/MatMul_quant", "MatMulInteger", ["x", "onnx::MatMul_1_quantized",
                                                                                    "x_zp", "zp"]))
             + field(5, tensor("onnx::MatMul_1_quantized", w, 3))
             + field(5, tensor("onnx::MatMul_1_scale", np.array([1.0, 0.5, 2.0], np.float32), 1))
             + field(5, tensor("zp", np.array([0, 1, 0], np.int8), 3)))
    inits, nodes = read_onnx(field(1, 8) + field(7, graph))
    assert nodes == [("/encoder/bert_encoder/MatMul_quant", "MatMulInteger",
                      ["x", "onnx::MatMul_1_quantized", "x_zp", "zp"])]
    assert np.array_equal(inits["onnx::MatMul_1_quantized"], w)
    deq = Dequantizer(inits, nodes)  # the zero point is found through the node that uses it
    assert np.array_equal(deq("onnx::MatMul_1_quantized", axis=1), np.array([[1, -1.5, 6], [4, 2, -12]], np.float32))


@pytest.mark.parametrize("node_name, module", [
    ("/encoder/text_encoder/cnn.0/cnn.0.0/Conv_quant", "text_encoder.cnn.0.0"),
    ("/decoder/decoder/asr_res/asr_res.0/Conv_quant", "decoder.asr_res.0"),
    ("/encoder/bert/encoder/albert_layer_groups.0/albert_layers.0/attention/query_3/MatMul_quant",
     "bert.encoder.albert_layer_groups.0.albert_layers.0.attention.query"),
    ("/encoder/F0.1/pool/ConvTranspose", "predictor.F0.1.pool"),
    ("/encoder/shared/LSTM_quant", "predictor.shared"),
    ("/encoder/predictor/text_encoder/lstms.0/LSTM_quant", "predictor.text_encoder.lstms.0"),
])
def test_node_scopes_name_the_checkpoint_s_modules(node_name: str, module: str) -> None:
    assert module_of(node_name) == module


def test_lstm_gates_go_from_onnx_order_to_pytorch_s_and_unknown_scopes_are_refused() -> None:
    iofc = np.repeat(np.array([0, 1, 2, 3], np.float32), 2)  # i, o, f, c blocks of 2
    assert _gates(iofc).tolist() == [0, 0, 2, 2, 3, 3, 1, 1]  # i, f, g (= c), o
    with pytest.raises(KokoroImportError, match="no scope"):
        module_of("/somewhere/else/MatMul")
    with pytest.raises(KokoroImportError, match="no graph"):
        read_onnx(field(1, 8))
