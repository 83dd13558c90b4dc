"""`python -m workers.broker`: the broker program, `vime.workers.broker` (also `bin/vime-broker`)."""

from vime.workers.broker import main

if __name__ == "__main__":
    main()
