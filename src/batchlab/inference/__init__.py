"""The trained model as users run it.

export    ONNX export (raw examples in, preprocessing in the graph), the parity gate; latency
quantize  int8 (dynamic or static) behind an F1 gate
readers   predict's input files (CSV, Parquet, .npy/.npz), each chunk checked
predict   raw examples in, class and probabilities out, through onnxruntime only
"""
