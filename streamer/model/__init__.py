"""The model: the only place torch, funasr and onnxruntime are imported (lazily).

- ``sensevoice``: SenseVoiceSmall's own layout (query rows, special ids, tag rendering)
- ``files``: locating and checking a torch/funasr model directory, the hub
- ``frontend``: fbank + LFR + CMVN features without torch
- ``decoding``: what every backend shares (greedy CTC with token frames, tokenizers,
  the transcript); a backend only turns waveforms into CTC logits
- ``recognizer`` (options, torch/funasr backend), ``onnx_backend`` (ONNX Runtime),
  ``onnx_export`` (torch model -> ONNX, cached by content hash)
- ``loading``: start-up checks and the staged, timed load of the chosen backend
- ``worker``: the thread that owns the recognizer and decodes the core's jobs
"""
