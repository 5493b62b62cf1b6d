"""Offline tools beside a run: `rehearse.py` (`make rehearse`: every shipped recipe and launch script for two steps
on CPU), `shrink.py` (a recipe shrunk to what 2 CPU cores hold), `export_hf.py` (`sluice export-hf`: a trainer
checkpoint as an HF directory), `smollm2.py` (a real instruct model for CPU runs).
May import: launch.run, launch.plan, launch.args, launch.config, launch.slime. Only launch.cli stands above it."""
