"""Model files on disk: hubs, published exports, ONNX export and quantization, the allocator."""
