"""`wan_tpu.serve`: one process that keeps a model loaded and compiled and serves it over HTTP (an entry
point above the families: the OpenAI Videos API for Wan, `/predict_action` for UnifoLM-WMA, the live
page for Matrix-Game-2). The command is `wan_tpu.serve.cli`; the app `wan_tpu.serve.app`."""
