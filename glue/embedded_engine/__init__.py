"""The embedded engine: a CPU stand-in for an SGLang server (HF transformers model, SGLang's HTTP API), started
as `python -m glue.embedded_engine`; `tiny_model.save_tiny_model` makes the small models it serves in tests, and
`tiny_text_model` the tiny text model with a real tokenizer that text-data runs start from; with such a tokenizer
the engine speaks text as SGLang does (`text_io`: text prompts, stop strings, the answer's text).
May import: types, plugins; weight_sync (the receiving side of its weight endpoints). Never another wing.
"""
