"""Text and image encoders: UMT5, CLIP towers and image encoder, OpenCLIP, tokenizers."""
