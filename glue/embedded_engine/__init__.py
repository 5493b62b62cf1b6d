"""The embedded engine: a CPU stand-in for an SGLang server (HF transformers model, SGLang's HTTP API), started
as `python -m glue.embedded_engine`; `tiny_model.save_tiny_model` makes the small models it serves in tests."""
