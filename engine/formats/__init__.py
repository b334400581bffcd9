"""File formats (chapter 01 and the default-model appendix): safetensors checkpoints, config.json,
GGUF files and their conversion into an ordinary Hugging Face model directory.
"""
