"""The trained model as users run it.

export    ONNX export and the parity gate against torch; latency
quantize  int8 dynamic quantization behind an F1 gate
readers   predict's input files (CSV, Parquet, .npy/.npz), each chunk checked
predict   raw rows in, class and probabilities out, through onnxruntime only
"""
