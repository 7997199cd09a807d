"""The Wan VAE (2.1 and 2.2), shared by Wan and Matrix-Game-2, and its loader."""
