"""sluice's launcher: YAML config + CLI overrides -> a validated run, then the fleet, trainer and loop."""
