"""`python -m launch` is the same as the `sluice` console script."""
from launch.cli import main

raise SystemExit(main())
