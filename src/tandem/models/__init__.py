"""Model definitions (Llama family, Qwen2/3) and loaders (HF safetensors directories, GGUF files)."""
