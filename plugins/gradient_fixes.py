"""Graph passes that make ONNX Runtime's gradients match PyTorch's where ORT's gradient builders are wrong."""
