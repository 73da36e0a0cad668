"""Model code: Llama-architecture forward pass, loaders (GGUF, Hugging Face), tokenizer, weight quantization."""
