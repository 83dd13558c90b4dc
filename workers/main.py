"""`python -m workers.main --role ...`: a worker program, `vime.workers.main` (also `bin/vime-worker`)."""

from vime.workers.main import main

if __name__ == "__main__":
    main()
