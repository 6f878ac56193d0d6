"""Per-op routing: ops ONNX Runtime cannot export, differentiate or run become ATen nodes run by PyTorch."""
