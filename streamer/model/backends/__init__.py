"""The recognizers: ONNX Runtime, torch (funasr), Silero VAD, and the loading that picks one."""
