"""padless: padding-free training for Hugging Face causal language models."""
