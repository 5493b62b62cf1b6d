"""sluice's glue: the driver loop, the data that crosses seams, engines, fleet and trainer.

Backends (ray, megatron, sglang) are imported lazily by the modules that need them.
"""
