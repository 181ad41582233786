"""The model: the Llama-family network and its attention, configs, weight formats (safetensors, GGUF, dummy), the tokenizer, and loading a `--model` value into all of them."""
