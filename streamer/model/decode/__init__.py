"""The decoding every backend shares: features, the CTC decoders, hotword graphs."""
