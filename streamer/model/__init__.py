"""The model: the only place torch, funasr and onnxruntime are imported (lazily).

- ``interface``, ``options``, ``sensevoice``: the seam between the worker and a
  recognizer, the options a model loads from, SenseVoiceSmall's own tables
- ``decode/``: what every backend shares (features, greedy and biased CTC, tokenizers,
  hotword graphs, the one decode path from a job to its transcript)
- ``backends/``: the torch and ONNX Runtime recognizers, Silero VAD, and the loading
  that picks one
- ``artifacts/``: model files on disk (hubs, published exports, ONNX export)
- ``serving/``: the worker thread, its queue and supervision, the pool, the model process
- ``speakers/``: the speaker diarization models and their worker

docs/architecture.md's package table says what each folder may import.
"""
