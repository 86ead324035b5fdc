# `python -m strata ...` and `torchrun -m strata train ...` both land here.
from strata.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
