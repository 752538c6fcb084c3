"""The trained model as users run it.

export    ONNX export and the parity gate against torch; latency
quantize  int8 dynamic quantization behind an F1 gate
predict   raw rows in, class and probabilities out, through onnxruntime only
"""
