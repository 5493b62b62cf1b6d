"""The command line: sluice's own flags and every back-end's pass-through table, generated from the back-end's own
definitions (`megatron.py`: megatron-core's config fields; `sglang.py`: SGLang's ServerArgs; `router.py`:
sgl-router's RouterArgs; `options.py`: an option as data), the parser that holds them all and takes argv apart
(`command_line.py`), and `sluice --help` (`help.py`).
May import: launch.config, launch.slime. Never plan, run or tools."""
