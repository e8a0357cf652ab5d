"""Device building blocks the models and the worker share: the attention-kernel interface and sampling."""
