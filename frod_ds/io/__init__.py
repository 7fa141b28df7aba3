"""Reading and writing tensors on disk: the base checkpoint (config.json + safetensors), safetensors files with
CRC-32, dtype names, the fingerprint of a checkpoint's tensors."""
