"""Random-weight SenseVoiceSmall models and synthesised speech, for tests, the bench and
``--model random:NAME``. Never needed to serve a real model.
"""
