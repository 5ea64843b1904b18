"""Speaker diarization's models: who spoke when, beside the ASR model.

``layout.py`` finds a diarizer's two ONNX graphs (an exported directory, or the
published sherpa-onnx exports through the hub), ``models.py`` runs them on ONNX Runtime
(pyannote segmentation-3.0 and the CAM++ speaker encoder, one thread each), ``worker.py``
is their one thread with a bounded queue, ``nets.py`` and ``export.py`` the torch side
(``streamer export-diarizer``, ``[torch]`` only). The online assignment of labels is
I/O-free, in ``core/diarization.py``.
"""
