"""The role programs: thin main loops that wire the library's pieces together (`vime-broker`,
`vime-worker --role rollout|reward|trainer`). Dependencies point one way: these import the rest of
`vime`; nothing else in `vime` imports them (tests/test_layering.py)."""
