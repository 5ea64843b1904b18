"""The model: the only place torch and funasr are imported (lazily, inside functions).

SenseVoiceSmall's own layout, locating and checking model files, the recognizer, and the
worker thread that owns it and decodes the core's jobs one at a time.
"""
